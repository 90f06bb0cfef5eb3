"""The largest model this box trains: ~1B parameters at BERT-Large width (hidden 1024, 16
heads, ffn 4096, 80 blocks) for a few steps, with the EPS holding everything in host memory.

Reports the EPS's peak resident memory (shared memory included) per parameter and the worker's
peak private memory (what would be device memory on a GPU), against the model's fp32 size.
"""

from __future__ import annotations

import argparse

from .common import check, l2l_job, table


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--stash", default="eps")
    p.add_argument("--lr", type=float, default=1e-4, help="BERT-Large scale: no 1e-3 steps")


def scale(a) -> dict:
    s = l2l_job(["--model", "bert", "--layers", str(a.layers), "--hidden", str(a.hidden),
                 "--heads", str(a.heads), "--seq-len", str(a.seq_len), "--vocab", "1024",
                 "--micro-batch-size", str(a.micro_batch_size), "--micro-batches",
                 str(a.micro_batches), "--threads", str(a.threads), "--stash", a.stash,
                 "--dropout", "0.1", "--lr", str(a.lr)], steps=a.steps)
    eps = s["eps"]
    params = eps["params"]
    eps_peak = eps["vmhwm_bytes"]
    worker_peak = s["workers"][0]["peak_memory_bytes"]
    steps = s["workers"][0]["step_seconds"]
    rows = [["parameters", f"{params / 1e9:.3f} B"],
            ["fp32 model size", f"{params * 4 / 2**30:.2f} GiB"],
            ["EPS peak resident (incl. shared memory)", f"{eps_peak / 2**30:.2f} GiB"],
            ["EPS bytes / parameter", f"{eps_peak / params:.2f}"],
            ["worker peak private memory", f"{worker_peak / 2**30:.3f} GiB"],
            ["step seconds", ", ".join(f"{t:.1f}" for t in steps)],
            ["losses", ", ".join(f"{x:.4f}" for x in s["losses"])]]
    return {
        "table": table(f"scale: bert L={a.layers} H={a.hidden} T={a.seq_len} "
                       f"u={a.micro_batches} B={a.micro_batch_size}", ["what", "value"], rows),
        "params": params, "eps_peak_bytes": eps_peak, "worker_peak_bytes": worker_peak,
        "step_seconds": steps, "losses": s["losses"],
        "ratios": {"eps_bytes_per_param": eps_peak / params,
                   "worker_peak_over_fp32_model": worker_peak / (params * 4)},
        "targets": [check("EPS bytes per parameter", eps_peak / params, "<=", 20.0),
                    check("worker peak private memory (GiB)", worker_peak / 2**30, "<", 1.5)],
    }
