"""``l2l-launch --plan``: the model's layers and tensors (the names --freeze matches), and the
shared memory a job's EPS will create, region by region, before anything starts, so a
container's ``shm_size`` (Docker's default /dev/shm is 64 MB) can be set from the model rather
than guessed. The sizes are those eps_server/layer_store.py allocates."""

from __future__ import annotations

import math
from typing import NamedTuple

from protocol.shards import master_spans, serves_master
from protocol.tensors import itemsize, plan_layout
from worker.models import build_model

from .config import LaunchArgs
from .roles import server_config

HEADROOM = 0.25  # at least this share more; and room for one worker's regions twice: a
# replacement gets fresh gradient slots (and stash arena) while its predecessor's drain


class Need(NamedTuple):
    what: str
    nbytes: int
    per_worker: bool = False  # the sum of one region per worker (made again for a replacement)


def shm_regions(args: LaunchArgs, model=None) -> list[Need]:
    """Every region, the stash arenas estimated (their size is set by the first activation a
    worker stashes)."""
    model = model or build_model(args.model)
    layout = plan_layout(model.manifest())
    server, w, n = server_config(args, "", "plan"), args.worker, args.launch.workers
    compute = server.compute_dtype
    grads = compute if w.grad_dtype == "compute" else "float32"
    # the master: every layer whole, served as it is (fp32, unsharded); else each layer's
    # trained prefix (--freeze, LoRA), or this box's span of it (--eps-mode shard), and the
    # served copy a region of its own, whole
    sharding = server.boxes.sharding
    whole = serves_master(compute, sharding)
    master = layout.total_numel if whole else sum(
        hi - lo for lo, hi in master_spans(layout.layers, sharding))
    parts = ([f"this box's 1/{sharding.count}"] if sharding else []) + (
        ["trained tensors"] if layout.frozen and not whole else [])
    label = "fp32 master weights" + (f" ({', '.join(parts)})" if parts else "")
    rows = [Need(label, 4 * max(1, master))]
    if not whole:
        rows.append(Need(f"{compute} compute copy", layout.nbytes(compute)))
    rows.append(Need("layer versions", 8 * len(layout.layers)))
    if server.recovery:
        rows.append(Need(f"previous versions ({compute}, recovery)", layout.nbytes(compute)))
    if w.transport == "shm":
        rows.append(Need(f"gradient slots: {n} workers x {server.grad_slots} x the largest "
                         f"trained part of a layer ({grads})", n * server.grad_slots
                         * layout.max_trainable_numel * itemsize(grads), per_worker=True))
    if w.stash == "eps":
        hidden = getattr(getattr(model, "config", None), "hidden_size", args.model.hidden)
        entry = w.micro_batch_size * args.model.seq_len * hidden * itemsize(compute)
        blocks = len(layout.layers) - 2
        rows.append(Need(f"stash arenas (about): {n} workers x {blocks} blocks x "
                         f"{w.micro_batches} micro-batches x one activation",
                         n * blocks * w.micro_batches * entry, per_worker=True))
    return rows


def recommended(rows: list[Need], workers: int) -> int:
    """Bytes for /dev/shm: the regions plus the larger of HEADROOM and one worker's share."""
    total = sum(r.nbytes for r in rows)
    per_worker = sum(r.nbytes for r in rows if r.per_worker) // workers
    return total + max(math.ceil(total * HEADROOM), per_worker)


def shm_size(nbytes: int) -> str:
    """A compose ``shm_size`` of at least ``nbytes``, in whole MiB (64 MiB at least)."""
    return f"{max(64, math.ceil(nbytes / 2**20))}m"


def size(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def tensor_lines(layers) -> list[str]:
    """The layers and their tensors as --freeze names them (``<layer>.<tensor>``), a run of
    layers alike (one kind, the same tensors) once."""
    def alike(layer):
        return layer.kind, [(t.name, t.shape, t.group, t.tie is None) for t in layer.tensors]

    lines = ["layers and their tensors (--freeze globs match <layer>.<tensor>):"]
    runs: list[list] = []
    for layer in layers:
        if runs and alike(runs[-1][-1]) == alike(layer):
            runs[-1].append(layer)
        else:
            runs.append([layer])
    for run in runs:
        first = run[0]
        name = first.name if len(run) == 1 else \
            f"{first.name} .. {run[-1].name} ({len(run)} layers alike)"
        lines.append(f"  {name}  [{first.kind}]")
        for t in first.tensors:
            what = {"frozen": ["frozen"], "no_decay": ["no weight decay"]}.get(t.group, [])
            what += [f"tied to {'.'.join(t.tie)}"] if t.tie else []
            lines.append(f"    {t.name}  {tuple(t.shape)}{'  ' + ', '.join(what) if what else ''}")
    return lines


def plan_text(args: LaunchArgs) -> str:
    model = build_model(args.model)
    rows = shm_regions(args, model)
    total = sum(r.nbytes for r in rows)
    width = max(len(r.what) for r in rows)
    lines = tensor_lines(model.manifest().layers)
    lines += [f"shared memory of the EPS ({args.model.model}, {args.launch.workers} workers, "
              f"{args.server.precision}):"]
    lines += [f"  {r.what:<{width}}  {size(r.nbytes):>14}" for r in rows]
    lines += [f"  {'total':<{width}}  {size(total):>14}",
              f"L2L_SHM_SIZE={shm_size(recommended(rows, args.launch.workers))}"]
    return "\n".join(lines)
