"""Worker peak memory by depth for each stash placement.

On CPU: the worker's peak *private* resident memory (RSS minus shared pages, sampled from
/proc), which is what would be device memory on a GPU: the EPS's shared memory (weights,
gradient slots, the eps stash arena) is not the worker's. On CUDA:
torch.cuda.max_memory_allocated. Depth grows 16x (4 -> 64 blocks) at equal per-layer work.
"""

from __future__ import annotations

import argparse

from .common import check, l2l_job, table


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--depths", default="4,16,64")
    p.add_argument("--stashes", default="device,host,eps")
    # A boundary of 2 MiB (32 x 128 x 128 fp32): a boundary per layer would show at 64 blocks.
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cpu")


def memory(a) -> dict:
    depths = [int(d) for d in a.depths.split(",")]
    stashes = a.stashes.split(",")
    peak: dict[str, dict[int, int]] = {s: {} for s in stashes}
    for stash in stashes:
        for depth in depths:
            s = l2l_job(["--model", "bert", "--layers", str(depth), "--hidden", str(a.hidden),
                         "--heads", "4", "--ffn", str(a.ffn), "--seq-len", str(a.seq_len),
                         "--vocab", "1024", "--micro-batch-size", str(a.micro_batch_size),
                         "--micro-batches", str(a.micro_batches), "--threads", "1",
                         "--device", a.device, "--stash", stash], steps=a.steps)
            peak[stash][depth] = s["workers"][0]["peak_memory_bytes"]
    lo, hi = depths[0], depths[-1]
    act = a.micro_batch_size * a.seq_len * a.hidden * 4
    rows = [[stash, *(peak[stash][d] / 2**20 for d in depths), peak[stash][hi] / peak[stash][lo]]
            for stash in stashes]
    targets = []
    if "eps" in peak:
        targets.append(check(f"eps stash: peak at {hi} / at {lo} blocks",
                             peak["eps"][hi] / peak["eps"][lo], "<=", 1.05))
    return {
        "table": table(f"memory: worker peak {'private RSS' if a.device == 'cpu' else 'CUDA'} "
                       f"(MiB); activation {act / 2**20:.2f} MiB x u={a.micro_batches} per block",
                       ["stash", *(f"{d} blocks" for d in depths), f"{hi}/{lo}"], rows),
        "peak_bytes": {s: {str(d): v for d, v in by.items()} for s, by in peak.items()},
        "ratios": {f"{s}_{hi}_over_{lo}": peak[s][hi] / peak[s][lo] for s in stashes},
        "targets": targets,
    }
