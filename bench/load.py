"""Load: N concurrent clients (real processes, 16 by default) against one eps-server, over shm
and over frames, each rank fetching every layer and pushing its gradient, step after step.

Reports p50/p99 latency of Fetch (a version that may not be there yet: it includes waiting for
the slowest rank's push and the update) and of PushGrad (until its GradAck), and pushes/s for
the whole job; the baseline is one client in the same run. Every rank pushes the constant
``rank + 1`` with SGD at lr 2^-10 from zero weights, so the final master is exactly
-steps * lr * sum(rank + 1) (every sum is exact in fp32): any update lost or counted twice
shows as a different value, and is counted.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time

import numpy as np
import torch

from protocol.tensors import plan_layout
from worker.eps_client import EpsClient
from worker.regions import GradSlots, Regions, layer_view

from .common import check, median, table
from .transfer import _manifest, _server

LR = 2.0 ** -10


def add_args(p) -> None:
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--numel", type=int, default=16384, help="parameters per layer")


def _client(endpoint: str, transport: str, rank: int, world: int, a, joined, out) -> None:
    torch.set_num_threads(1)
    manifest = _manifest(a.layers, a.numel)
    layout = plan_layout(manifest)
    client, regions = EpsClient(endpoint, timeout=300), Regions(pin=False)
    try:
        welcome = client.hello(rank=rank, world_size=world, manifest=manifest,
                               transport=transport, grad_dtype="float32")
        for layer in welcome.init_layers:
            client.wait(client.init_layer(layer, torch.zeros(a.numel).numpy().data))
        joined.set()
        client.start_heartbeats(welcome.heartbeat_interval)
        slots = GradSlots(regions, welcome, layout, torch.float32) if transport == "shm" \
            else None
        grad = torch.full((a.numel,), float(rank + 1))
        fetches, pushes = [], []
        t0 = time.perf_counter()
        for step in range(a.steps):
            for layer in range(a.layers):
                t = time.perf_counter()
                client.wait(client.fetch(layer, step))
                fetches.append(time.perf_counter() - t)
            for plan in reversed(layout.layers):
                if slots is not None:
                    slots.slot(0, plan).copy_(grad)
                t = time.perf_counter()
                client.wait(client.push_grad(step=step, layer=plan.index, rank=rank,
                                             slot=0 if slots else -1, dtype="float32",
                                             data=None if slots else grad.numpy().data))
                pushes.append(time.perf_counter() - t)
        elapsed = time.perf_counter() - t0
        final = []
        if rank == 0:  # the masters once every rank's last push is in
            if transport == "shm":
                regions.attach(welcome.master, writable=False)
            for plan in layout.layers:
                ready, frames = client.wait(client.fetch(plan.index, a.steps, which="master"))
                final.append(layer_view(regions, plan, ready, frames).numpy().copy())
        client.bye(rank, done=True)
        out.put((rank, fetches, pushes, elapsed, final))
    except BaseException as e:
        out.put((rank, repr(e), None, None, None))
        raise
    finally:
        regions.close()
        client.close()


def _job(transport: str, clients: int, a) -> dict:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="l2l-load-") as tmp:
        server = _server(f"ipc://{tmp}/eps.sock", f"{tmp}/eps.events",
                         "--world-size", str(clients), "--optimizer", "sgd", "--lr", str(LR),
                         "--weight-decay", "0", "--exit-when-done")
        out, joined = ctx.Queue(), ctx.Event()
        procs = []
        try:
            t0 = time.perf_counter()
            for rank in range(clients):  # rank 0 creates the model, the others join it
                p = ctx.Process(target=_client, args=(f"ipc://{tmp}/eps.sock", transport, rank,
                                                      clients, a, joined, out), daemon=True)
                p.start()
                procs.append(p)
                if rank == 0 and not joined.wait(120):
                    raise RuntimeError("rank 0 did not join")
            results = [out.get(timeout=600) for _ in range(clients)]
            wall = time.perf_counter() - t0
            failed = [r for r in results if r[2] is None]
            if failed:
                raise RuntimeError(f"clients failed: {failed}")
            server.wait(120)
        finally:
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
            if server.poll() is None:
                server.kill()
                server.wait()
    fetches = np.concatenate([r[1] for r in results]) * 1e3
    pushes = np.concatenate([r[2] for r in results]) * 1e3
    [final] = [r[4] for r in results if r[0] == 0]
    want = np.float32(-a.steps * LR * sum(r + 1 for r in range(clients)))
    per_update = LR * sum(r + 1 for r in range(clients))  # one step's change of a weight
    wrong = sum(int((m != want).sum()) for m in final)
    # A weight off by k updates: lost (k > 0) or counted twice (k < 0).
    off = np.concatenate([np.rint((m - want) / per_update) for m in final])
    return {"clients": clients, "transport": transport,
            "fetch_p50_ms": float(np.percentile(fetches, 50)),
            "fetch_p99_ms": float(np.percentile(fetches, 99)),
            "push_p50_ms": float(np.percentile(pushes, 50)),
            "push_p99_ms": float(np.percentile(pushes, 99)),
            "pushes_per_s": len(pushes) / median([r[3] for r in results]),
            "pushes": len(pushes), "wall_s": wall, "wrong_weights": wrong,
            "updates_lost": int((off > 0).sum()), "updates_doubled": int((off < 0).sum())}


def load(a) -> dict:
    runs = []
    for transport in ("shm", "frames"):
        runs.append(_job(transport, 1, a))  # the baseline: one client, same run
        runs.append(_job(transport, a.clients, a))
    rows = [[f"{r['transport']} x{r['clients']}", r["fetch_p50_ms"], r["fetch_p99_ms"],
             r["push_p50_ms"], r["push_p99_ms"], r["pushes_per_s"],
             r["pushes_per_s"] / base["pushes_per_s"], r["wrong_weights"]]
            for base, r in ((runs[i - i % 2], runs[i]) for i in range(len(runs)))]
    targets = []
    for r in runs:
        targets.append(check(f"{r['transport']} x{r['clients']}: weights off (updates lost "
                             "or doubled)", r["wrong_weights"], "<=", 0))
    for i in (1, 3):
        targets.append(check(f"{runs[i]['transport']}: pushes/s with {a.clients} clients / 1",
                             runs[i]["pushes_per_s"] / runs[i - 1]["pushes_per_s"], ">=", 1.0))
    return {
        "table": table(f"load: {a.clients} clients x {a.steps} steps x {a.layers} layers of "
                       f"{a.numel * 4 / 1024:.0f} KiB ({os.cpu_count()} cpus)",
                       ["run", "fetch p50 ms", "fetch p99 ms", "push p50 ms", "push p99 ms",
                        "pushes/s", "vs 1 client", "wrong"], rows),
        "runs": runs, "targets": targets,
    }
