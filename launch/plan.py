"""``l2l-launch --plan``: the shared memory a job's EPS will create, region by region, before
anything starts, so a container's ``shm_size`` (Docker's default /dev/shm is 64 MB) can be set
from the model rather than guessed. The sizes are those eps_server/layer_store.py allocates."""

from __future__ import annotations

import math

from protocol.tensors import itemsize, plan_layout
from worker.models import build_model

from .config import LaunchArgs
from .roles import server_config

HEADROOM = 0.25  # at least this share more; and room for one worker's regions twice: a
# replacement gets fresh gradient slots (and stash arena) while its predecessor's drain


def shm_regions(args: LaunchArgs) -> list[tuple[str, int]]:
    """(what, bytes) of every region, the stash arenas estimated (their size is set by the
    first activation a worker stashes)."""
    model = build_model(args.model)
    layout = plan_layout(model.manifest())
    server, w, n = server_config(args, "", "plan"), args.worker, args.launch.workers
    compute = server.compute_dtype
    grads = compute if w.grad_dtype == "compute" else "float32"
    rows = [("fp32 master weights", layout.nbytes("float32"))]
    if compute != "float32":
        rows.append((f"{compute} compute copy", layout.nbytes(compute)))
    rows.append(("layer versions", 8 * len(layout.layers)))
    if server.recovery:
        rows.append((f"previous versions ({compute}, recovery)", layout.nbytes(compute)))
    if w.transport == "shm":
        rows.append((f"gradient slots: {n} workers x {server.grad_slots} x the largest layer "
                     f"({grads})", n * server.grad_slots * layout.max_layer_numel
                     * itemsize(grads)))
    if w.stash == "eps":
        hidden = getattr(getattr(model, "config", None), "hidden_size", args.model.hidden)
        entry = w.micro_batch_size * args.model.seq_len * hidden * itemsize(compute)
        blocks = len(layout.layers) - 2
        rows.append((f"stash arenas (about): {n} workers x {blocks} blocks x "
                     f"{w.micro_batches} micro-batches x one activation",
                     n * blocks * w.micro_batches * entry))
    return rows


def recommended(rows: list[tuple[str, int]], workers: int) -> int:
    """Bytes for /dev/shm: the regions plus the larger of HEADROOM and one worker's share."""
    total = sum(b for _, b in rows)
    per_worker = sum(b for what, b in rows if what.startswith(("gradient", "stash"))) // workers
    return total + max(math.ceil(total * HEADROOM), per_worker)


def shm_size(nbytes: int) -> str:
    """A compose ``shm_size`` of at least ``nbytes``, in whole MiB (64 MiB at least)."""
    return f"{max(64, math.ceil(nbytes / 2**20))}m"


def size(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def plan_text(args: LaunchArgs) -> str:
    rows = shm_regions(args)
    total = sum(b for _, b in rows)
    width = max(len(what) for what, _ in rows)
    lines = [f"shared memory of the EPS ({args.model.model}, {args.launch.workers} workers, "
             f"{args.server.precision}):"]
    lines += [f"  {what:<{width}}  {size(b):>14}" for what, b in rows]
    lines += [f"  {'total':<{width}}  {size(total):>14}",
              f"L2L_SHM_SIZE={shm_size(recommended(rows, args.launch.workers))}"]
    return "\n".join(lines)
