"""Engines: the EPS's update throughput on this host, which bounds a GPU job's step time when
the GPU is fast (the next forward waits for the last layers' updates).

One step's work with one worker, as the EPS gets it: bf16 gradients of LAYERS BERT layers,
pushed last layer first as a backward pass does, each reduced (checked finite) and updated
(AdamW with the bf16 compute copy) by the real engines at --server-threads 1, half the cores
and every core. Reports GB/s (38 B a parameter: the gradient read twice, the accumulator
written and read, AdamW's p, m, v read and written, the copy written), the speed-up over
one thread, and the host's streaming bandwidth at the same threads (``x.add_(y)``), all
measured in the same run.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

from eps_server.config import OptimizerConfig, available_cores
from eps_server.engines import Engines, LayerMath, Reduce, Update
from eps_server.optimizers import make_optimizer

from .common import check, median, table
from .optimizer import bert_layer

BYTES_PER_PARAM = 38


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", default="", help="comma-separated; default: 1, half, all cores")


class _NoRecovery:
    """What an update asks of the layer store: a copy for --recovery, which is off here."""

    def retain(self, layer: int) -> None:
        pass


def step_seconds(threads: int, layers: int, hidden: int, reps: int) -> float:
    """Median seconds from the first gradient handed to the engines until every layer is
    updated (after one warm-up step)."""
    plan = bert_layer(hidden)
    n = plan.numel
    cfg = OptimizerConfig(name="adamw", lr=1e-4, weight_decay=0.01)
    maths = [LayerMath(make_optimizer(plan, torch.randn(n) * 0.02, torch.zeros(n),
                                      torch.empty(n, dtype=torch.bfloat16), cfg), torch.zeros(n))
             for _ in range(layers)]
    grads = [(torch.randn(n) * 1e-3).bfloat16() for _ in range(layers)]
    done, errors, all_done = [0], [], threading.Event()

    def on_done(d) -> None:  # on an engine's thread
        errors.extend([d.error] if d.error is not None else [])
        done[0] += 1
        if done[0] == 2 * layers or errors:
            all_done.set()

    torch.set_num_threads(threads)
    engines = Engines(_NoRecovery(), maths, threads, on_done)
    times = []
    try:
        for t in range(reps + 1):
            done[0] = 0
            all_done.clear()
            t0 = time.perf_counter()
            for layer in reversed(range(layers)):
                engines.submit(Reduce(layer, 0, grads[layer], True))
                engines.submit(Update(layer, t, 1.0, False, cfg))
            if not all_done.wait(600) or errors:
                raise RuntimeError(f"the engines did not finish a step: {errors or 'in 600 s'}")
            if t:
                times.append(time.perf_counter() - t0)
    finally:
        engines.close()
    return median(times)


def streaming_gb_per_s(threads: int, numel: int = 1 << 25, reps: int = 5) -> float:
    """The host's in-place streaming bandwidth at ``threads`` (x.add_(y): 12 B an element),
    the ceiling for a memory-bound update."""
    torch.set_num_threads(threads)
    x, y = torch.randn(numel), torch.randn(numel)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        x.add_(y, alpha=1e-9)
        times.append(time.perf_counter() - t0)
    return 12 * numel / median(times[1:]) / 1e9


def thread_counts(spec: str) -> list[int]:
    cores = available_cores()
    return [int(x) for x in spec.split(",")] if spec else sorted({1, max(1, cores // 2), cores})


def engines(a) -> dict:
    counts = thread_counts(a.threads)
    params = bert_layer(a.hidden).numel * a.layers
    seconds = {k: step_seconds(k, a.layers, a.hidden, a.reps) for k in counts}
    stream = {k: streaming_gb_per_s(k) for k in counts}
    gbs = {k: BYTES_PER_PARAM * params / s / 1e9 for k, s in seconds.items()}
    base = seconds[counts[0]]
    rows = [[k, s, gbs[k], base / s, stream[k], gbs[k] / stream[k]] for k, s in seconds.items()]
    return {"table": table(f"engines: one step of {a.layers} BERT layers (H={a.hidden}, "
                           f"{params / 1e6:.0f}M params) through the EPS's engines, "
                           f"{available_cores()} cores",
                           ["threads", "seconds", "GB/s", f"speed-up vs {counts[0]}",
                            "streaming GB/s", "of streaming"], rows),
            "step_seconds": seconds, "params": params, "gb_per_s": gbs,
            "streaming_gb_per_s": stream,
            "targets": [check(f"speed at {counts[-1]} threads / at {counts[0]}: no slower",
                              base / seconds[counts[-1]], ">=", 0.95)] if len(counts) > 1
            else []}
