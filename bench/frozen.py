"""What a frozen bottom saves: the backward stopping at the lowest layer that trains (the
layers below run forward only) against the same job visiting every layer in its backward, as
it did before (``Executor.lowest`` set to 0), in-process on this machine's CPU, the two timed
in alternating rounds. Bottom halves frozen as LoRA's ``--lora-layers`` of the top half, or
``--freeze`` of the first blocks, leave them; a frozen embedding alone, as any LoRA job.
"""

from __future__ import annotations

import argparse

import torch

from worker.config import ModelConfig

from .common import check, interleaved, table
from .local import local_executor


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)


def _stepper(mcfg: ModelConfig, a, stop_early: bool):
    ex = local_executor(mcfg, micro_batches=a.micro_batches, batch_size=a.micro_batch_size,
                        steps=10**6)
    if not stop_early:
        ex.lowest = 0
    steps = iter(range(10**6))
    return lambda: ex.run_step(next(steps))


def frozen(a) -> dict:
    torch.set_num_threads(2)
    half = a.layers // 2
    bottom = ",".join(["pre.*"] + [f"blocks.{i}.*" for i in range(half)])
    cases = [(bottom, f"embedding and blocks 0-{half - 1}"),
             ("pre.*", "embedding")]
    rows, targets = [], []
    for freeze, what in cases:
        mcfg = ModelConfig(model=a.model, layers=a.layers, hidden=a.hidden, heads=a.heads,
                           seq_len=a.seq_len, vocab=4096, freeze=freeze)
        t = interleaved({"every": _stepper(mcfg, a, False), "lowest": _stepper(mcfg, a, True)},
                        a.repeats, warmup=1)
        rows.append([what, t["every"] * 1e3, t["lowest"] * 1e3, t["every"] / t["lowest"]])
        if freeze != "pre.*":  # (a frozen embedding's backward was a lookup: no gain on a CPU)
            targets.append(check(f"frozen {what}: step time, every layer / stopping early",
                                 t["every"] / t["lowest"], ">=", 1.2))
    return {"table": table(f"frozen: {a.model} {a.layers} blocks H={a.hidden} T={a.seq_len} "
                           f"u={a.micro_batches} x B={a.micro_batch_size}, CPU 2 threads",
                           ["frozen", "every layer (ms)", "stopping early (ms)", "speed-up"],
                           rows),
            "targets": targets}
