"""The cross-box collectives the EPS runs, measured alone: ``python -m bench collectives``.

N processes on this machine join a gloo group over loopback TCP (as the EPSes of N boxes do)
and time, for a layer's fp32 gradient of each size, what each ``--eps-mode`` runs per layer:
``replicate`` an all-reduce; ``shard`` a scatter of the sum then a gather of the served copy,
both as gloo offers them (reduce_scatter_tensor, all_gather_into_tensor) and as the EPS runs
them (eps_server/boxes.py: an all-reduce, then one broadcast per box). Bus bandwidth (the bytes
each rank sends, 2(N-1)/N of the buffer for an all-reduce) is the figure to hold against a
link: 25 Gbit/s is 3.1 GB/s, 100 Gbit/s 12.5 GB/s. Loopback has no wire, so this is gloo's own
ceiling on this host (its copies, its summation, the kernel's TCP).

With CUDA it also times what NCCL through a GPU of the box would add to each layer (one GPU
cannot hold two NCCL ranks, so NCCL's own transfer is not measured here): the gradient copied
from the EPS's pinned memory to the device and the result back.
"""

from __future__ import annotations

import argparse
import os
import queue
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from eps_server.boxes import all_gather, reduce_scatter

from .common import free_port, table

LINKS = {"25 Gbit/s": 25e9 / 8, "100 Gbit/s": 100e9 / 8}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", default="2,4", help="numbers of boxes, comma-separated")
    p.add_argument("--mib", default="16,64,256", help="fp32 gradient sizes (MiB)")
    p.add_argument("--repeat", type=int, default=5)


def _timed(fn, repeat: int) -> float:
    """The median of ``repeat`` runs of ``fn`` after one warm-up, every rank in step."""
    fn()
    times = []
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _rank(rank: int, n: int, port: int, sizes: list[int], repeat: int, out) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=n)
    try:
        for numel in sizes:
            numel -= numel % n  # count x chunk, as the EPS pads a layer
            grad = torch.randn(numel)
            shard = torch.empty(numel // n)
            whole = torch.empty(numel)
            reduce = _timed(lambda: dist.all_reduce(grad), repeat)
            scatter = _timed(lambda: dist.reduce_scatter_tensor(shard, grad), repeat)
            gather = _timed(lambda: dist.all_gather_into_tensor(whole, shard), repeat)
            eps_scatter = _timed(lambda: reduce_scatter(shard, grad, rank), repeat)
            eps_gather = _timed(lambda: all_gather(whole, shard, rank), repeat)
            if rank == 0:
                out.put((numel, reduce, scatter, gather, eps_scatter, eps_gather))
    finally:
        dist.destroy_process_group()


def _gloo(n: int, sizes: list[int], repeat: int) -> list[tuple]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, n, port, sizes, repeat, out)) for r in range(n)]
    for p in procs:
        p.start()
    rows = []
    try:
        while len(rows) < len(sizes):
            try:
                rows.append(out.get(timeout=2))
            except queue.Empty:
                if any(p.exitcode for p in procs):
                    raise RuntimeError("a gloo rank failed: exit codes "
                                       f"{[p.exitcode for p in procs]}") from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return rows


def _staging(numel: int, repeat: int) -> float:
    """Seconds to copy a pinned fp32 buffer to the GPU and back (NCCL's extra per layer)."""
    host = torch.randn(numel).pin_memory()
    dev = torch.empty(numel, device="cuda")

    def both():
        dev.copy_(host, non_blocking=True)
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
    both()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        both()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def collectives(a) -> dict:
    sizes = [int(m) * 2**20 // 4 for m in str(a.mib).split(",")]
    headers = ["boxes", "MiB", "all-reduce s", "bus GB/s", "gloo scatter s", "gloo gather s",
               "EPS scatter s", "EPS gather s", "shard vs all-reduce"]
    rows, out = [], {"targets": [], "gloo": []}
    for n in (int(k) for k in str(a.ranks).split(",")):
        for numel, reduce, scatter, gather, eps_scatter, eps_gather in _gloo(n, sizes, a.repeat):
            moved = 2 * (n - 1) / n * numel * 4  # bytes each rank sends in an all-reduce
            rows.append([n, numel * 4 // 2**20, reduce, moved / reduce / 1e9, scatter, gather,
                         eps_scatter, eps_gather, (eps_scatter + eps_gather) / reduce])
            out["gloo"].append({"boxes": n, "bytes": numel * 4, "all_reduce_s": reduce,
                                "reduce_scatter_s": scatter, "all_gather_s": gather,
                                "eps_scatter_s": eps_scatter, "eps_gather_s": eps_gather})
    tables = [table(f"gloo on loopback ({os.cpu_count()} cores); links: "
                    + ", ".join(f"{k} = {v / 1e9:.1f} GB/s" for k, v in LINKS.items()),
                    headers, rows)]
    if torch.cuda.is_available():
        stage = [[numel * 4 // 2**20, s := _staging(numel, a.repeat), 2 * numel * 4 / s / 1e9]
                 for numel in sizes]
        out["staging"] = [{"bytes": r[0] * 2**20, "seconds": r[1]} for r in stage]
        tables.append(table(f"NCCL's staging per layer on {torch.cuda.get_device_name()}: "
                            "pinned host -> device -> host", ["MiB", "s", "GB/s"], stage))
    return out | {"table": "\n\n".join(tables)}
