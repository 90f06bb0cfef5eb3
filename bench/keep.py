"""What a kept graph buys per byte: a whole block's graph vs only its matmul outputs.

For one block (built-in BERT or GPT at the bench's shape, on this machine's CPU): the bytes
its forward saves for the backward (each storage once, not its input or weights) and its
forward's time, against the bytes and time of its matmuls alone (mm, addmm, bmm, attention
kernels: what selective checkpointing would keep, recomputing the rest). Seconds of
recompute saved per GiB of device memory spent decide which to buy (worker/keep.py).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from protocol.tensors import named_views, plan_layout
from worker.config import ModelConfig
from worker.data import Sharder, build_task
from worker.keep import SavedBytes
from worker.models import build_model

from .common import median, table

MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention"}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="bert")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)


class _Matmuls(TorchDispatchMode):
    """Times every op (the previous op's work done) and sizes the matmuls' outputs."""

    def __init__(self):
        super().__init__()
        self.seconds = self.out_bytes = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in MATMULS:
            self.seconds += time.perf_counter() - t
            first = out[0] if isinstance(out, tuple) else out
            self.out_bytes += first.numel() * first.element_size()
        return out


def keep(a) -> dict:
    torch.set_num_threads(1)
    mcfg = ModelConfig(model=a.model, layers=2, hidden=a.hidden, heads=a.heads,
                       seq_len=a.seq_len, vocab=1024, dropout=0.1)
    model = build_model(mcfg)
    layout = plan_layout(model.manifest())
    task = build_task(model, None, micro_batch_size=a.micro_batch_size, global_micro_batches=1)
    batch = Sharder(task, a.micro_batch_size, 1).batches(0, range(1))[0]
    stages = [model.template(p.kind).bind(named_views(model.init_flat(p.index, p), p))
              for p in layout.layers[:2]]
    with torch.no_grad():
        x = stages[0](None, batch)
    block = layout.layers[1]
    weights = {n: t.detach().requires_grad_()
               for n, t in named_views(model.init_flat(1, block), block).items()}
    stage = model.template(block.kind).bind(weights)

    def forward():
        x_in = x.detach().requires_grad_()
        return x_in, stage(x_in, batch)

    saved = SavedBytes()
    with saved.hooks():
        x_in, out = forward()
    full_bytes = saved.total(exclude=[x_in, *weights.values()])
    times, mm_times, mm_bytes = [], [], 0.0
    for _ in range(a.repeats):
        t = time.perf_counter()
        forward()
        times.append(time.perf_counter() - t)
        with _Matmuls() as mode:
            forward()
        mm_times.append(mode.seconds)
        mm_bytes = mode.out_bytes
    fwd, mm = median(times), median(mm_times)
    per_gib = {"whole graph": fwd / (full_bytes / 2**30), "matmul outputs": mm / (mm_bytes / 2**30)}
    rows = [["whole graph", full_bytes / 2**20, fwd * 1e3, per_gib["whole graph"]],
            ["matmul outputs only", mm_bytes / 2**20, mm * 1e3, per_gib["matmul outputs"]]]
    return {
        "table": table(f"keep: one {a.model} block H={a.hidden} T={a.seq_len} "
                       f"B={a.micro_batch_size}, CPU 1 thread",
                       ["kept", "MiB", "recompute saved (ms)", "s saved per GiB"], rows),
        "bytes": {"whole": full_bytes, "matmuls": mm_bytes},
        "seconds": {"forward": fwd, "matmuls": mm},
        "ratios": {"matmul_bytes_share": mm_bytes / full_bytes, "matmul_time_share": mm / fwd},
        "targets": [],
    }
