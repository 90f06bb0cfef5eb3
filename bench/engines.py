"""Engines: the EPS's update throughput on this host, which bounds a GPU job's step time when
the GPU is fast (the next forward waits for the last layers' updates), against the host's
own memory bandwidth measured in the same run.

One step's work as the EPS gets it: bf16 gradients of LAYERS BERT layers (at least 1 GiB of
fp32 master by default), pushed last layer first as a backward pass does, through the real
engines and math pool (eps_server.engines), AdamW with the bf16 compute copy, at 1 thread and
every core; and one layer alone (the last layers of a backward are updated alone). Each mode
is counted by the bytes it really moves per parameter:

    one worker      check 2 (the pushed bf16 gradient read for finiteness and norm) + update
                    28 (gradient 2, p, m, v read and written 24, compute copy 2) = 30
    two workers     check 4 + update 30 (two gradients read) = 34
    speculative     one worker, eager with --clip-norm: + 2 (the gradient kept) = 32
    bf16 states     one worker: m, v in bf16: 30 - 8 = 22

beside the host's triad (a = b + s*c, 12 B an element, torch at the same threads) and the
EPS's previous way (the pushed gradient copied into an fp32 accumulator, torch's fused AdamW
per chunk with its copy: 38 B/param on one engine's threads), measured in the same run.
"""

from __future__ import annotations

import argparse
import math
import threading
import time

import torch

from eps_server.buffers import BufferPool
from eps_server.config import OptimizerConfig, available_cores
from eps_server.engines import Engines
from eps_server.jobs import Action, Part, Update
from eps_server.layer_math import LayerMath
from eps_server.optimizers import make_optimizer
from eps_server.pool import MathPool
from eps_server.speculation import StepNorms

from .common import check, median, table
from .optimizer import bert_layer

MODES = {  # name -> (bytes a parameter moves, workers, action, optimizer states)
    "one worker": (30, 1, Action.FINAL, "fp32"),
    "two workers": (34, 2, Action.FINAL, "fp32"),
    "speculative (clip)": (32, 1, Action.SPECULATE, "fp32"),
    "bf16 states": (22, 1, Action.FINAL, "bf16"),
}
OLD_BYTES = 38


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=22, help="22 BERT-Large layers: 1.03 GiB "
                   "of fp32 master")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", default="", help="comma-separated; default: 1 and every core")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(
        MODES))


class _NoRecovery:
    """What an update asks of the layer store: a copy for --recovery, which is off here."""

    def retain(self, layer: int) -> None:
        pass


class Model:
    """LAYERS layers' master, moments, compute copies and one step's bf16 gradients."""

    def __init__(self, layers: int, hidden: int, states: str, workers: int):
        self.plan = bert_layer(hidden)
        n = self.plan.numel
        self.cfg = OptimizerConfig(name="adamw", lr=1e-4, weight_decay=0.01, states=states)
        g = torch.Generator().manual_seed(0)
        self.masters = [torch.randn(n, generator=g) * 0.02 for _ in range(layers)]
        self.computes = [torch.empty(n, dtype=torch.bfloat16) for _ in range(layers)]
        self.grads = [[(torch.randn(n, generator=g) * 1e-3).bfloat16() for _ in range(layers)]
                      for _ in range(workers)]
        self.layers = layers

    def maths(self, pool: MathPool, buffers: BufferPool) -> list[LayerMath]:
        return [LayerMath(self.plan, make_optimizer(self.plan, m, c, self.cfg, pool=pool,
                                                    buffers=buffers), pool, buffers)
                for m, c in zip(self.masters, self.computes)]

    def parts(self, layer: int) -> tuple[Part, ...]:
        return tuple(Part(w[layer], None) for w in self.grads)


def step_seconds(model: Model, threads: int, action: Action, layers: list[int],
                 reps: int) -> float:
    """Median seconds from the first gradient handed to the engines until ``layers`` are
    updated, in that order (after one warm-up step)."""
    pool, buffers = MathPool(threads), BufferPool()
    maths = model.maths(pool, buffers)
    done, errors, all_done, lock = [0], [], threading.Event(), threading.Lock()

    def on_done(d) -> None:  # on an engine's thread (several at once)
        kept = d.result.kept if d.error is None else None
        if kept is not None:
            maths[d.job.layer].release(kept)
        with lock:
            errors.extend([d.error] if d.error is not None else [])
            done[0] += 1
            if done[0] == len(layers) or errors:
                all_done.set()

    engines = Engines(_NoRecovery(), maths, threads, on_done)
    times = []
    try:
        for t in range(reps + 1):
            done[0] = 0
            all_done.clear()
            t0 = time.perf_counter()
            # speculative: the step's norms, never above the clip (every update stands)
            norms = StepNorms(len(layers), math.inf) if action is Action.SPECULATE else None
            for layer in layers:
                engines.submit(Update(layer, t, model.parts(layer), action, 1.0, model.cfg,
                                      norms))
            if not all_done.wait(600) or errors:
                raise RuntimeError(f"the engines did not finish a step: {errors or 'in 600 s'}")
            if t:
                times.append(time.perf_counter() - t0)
    finally:
        engines.close()
        pool.close()
    return median(times)


def old_step_seconds(model: Model, threads: int, layers: list[int], reps: int) -> float:
    """The previous engines' work for one worker: the bf16 gradient copied into an fp32
    accumulator, then torch's fused AdamW chunk by chunk with the compute copy, each layer on
    one engine thread with ``threads`` torch threads (one layer at a time here)."""
    torch.set_num_threads(threads)
    n, chunk = model.plan.numel, 1 << 18
    acc = torch.empty(n)
    state = [(torch.zeros(n), torch.zeros(n), torch.zeros(())) for _ in layers]
    times = []
    for t in range(reps + 1):
        t0 = time.perf_counter()
        for (m, v, steps), layer in zip(state, layers):
            p, c, g = model.masters[layer], model.computes[layer], model.grads[0][layer]
            acc.copy_(g)
            steps += 1
            for lo in range(0, n, chunk):
                hi = min(n, lo + chunk)
                torch._fused_adamw_([p[lo:hi]], [acc[lo:hi]], [m[lo:hi]], [v[lo:hi]], [],
                                    [steps], lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01,
                                    eps=1e-8, amsgrad=False, maximize=False)
                c[lo:hi].copy_(p[lo:hi])
        if t:
            times.append(time.perf_counter() - t0)
    return median(times)


def triad_gb_per_s(threads: int, numel: int = 1 << 27, reps: int = 5) -> float:
    """The host's triad (a = b + s*c: 12 B an element) with torch at ``threads``, on arrays
    far beyond the caches (512 MiB each)."""
    torch.set_num_threads(threads)
    a, b, c = torch.empty(numel), torch.randn(numel), torch.randn(numel)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        torch.add(b, c, alpha=0.5, out=a)
        times.append(time.perf_counter() - t0)
    return 12 * numel / median(times[1:]) / 1e9


def thread_counts(spec: str) -> list[int]:
    cores = available_cores()
    return [int(x) for x in spec.split(",")] if spec else sorted({1, cores})


def engines(a) -> dict:
    counts = thread_counts(a.threads)
    before = torch.get_num_threads()
    try:
        return _engines(a, counts)
    finally:
        torch.set_num_threads(before)


def _engines(a, counts: list[int]) -> dict:
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"unknown modes: {', '.join(unknown)}; known: {', '.join(MODES)}")
    params = bert_layer(a.hidden).numel * a.layers
    triads: dict[int, list[float]] = {k: [] for k in counts}  # measured beside every mode
    rows, results = [], {}

    def triad_now(k: int) -> float:
        triads[k].append(triad_gb_per_s(k))
        return triads[k][-1]

    order = list(reversed(range(a.layers)))
    for mode in modes:
        nbytes, workers, action, states = MODES[mode]
        model = Model(a.layers, a.hidden, states, workers)
        for k in counts:
            triad = triad_now(k)
            s = step_seconds(model, k, action, order, a.reps)
            gbs = nbytes * params / s / 1e9
            results[f"{mode} @ {k}"] = {"seconds": s, "gb_per_s": gbs, "of_triad": gbs / triad}
            rows.append([mode, nbytes, k, s, gbs, triad, gbs / triad])
        del model
    model = Model(a.layers, a.hidden, "fp32", 1)
    for k in counts:
        triad = triad_now(k)
        s = old_step_seconds(model, k, order, a.reps)
        gbs = OLD_BYTES * params / s / 1e9
        results[f"previous @ {k}"] = {"seconds": s, "gb_per_s": gbs, "of_triad": gbs / triad}
        rows.append(["previous engines (accumulator copy, torch fused)", OLD_BYTES, k, s, gbs,
                     triad, gbs / triad])
    lone, lone_triad = {}, {}
    for k in counts:
        lone_triad[k] = triad_now(k)
        lone[k] = step_seconds(model, k, Action.FINAL, [0], a.reps * 5)
        gbs = 30 * params / a.layers / lone[k] / 1e9
        rows.append(["one layer alone", 30, k, lone[k], gbs, lone_triad[k], gbs / lone_triad[k]])
    del model
    triad = {k: median(v) for k, v in triads.items()}
    out = {"table": table(
        f"engines: one step of {a.layers} BERT layers (H={a.hidden}, {params / 1e6:.0f}M "
        f"params, {4 * params / 2**30:.2f} GiB fp32) through the EPS's engines and math pool, "
        f"{available_cores()} cores", ["mode", "B/param", "threads", "seconds", "GB/s",
                                       "triad GB/s", "of triad"], rows),
        "params": params, "triad_gb_per_s": triad, "triads": triads, "modes": results,
        "lone_seconds": lone}
    hi, lo = counts[-1], counts[0]
    targets = []
    if "one worker" in modes:
        targets.append(check(f"one worker at {hi} threads, of the triad at {hi}",
                             results[f"one worker @ {hi}"]["of_triad"], ">=", 0.7))
        targets.append(check(f"one worker / previous engines at {hi} threads",
                             results[f"previous @ {hi}"]["seconds"]
                             / results[f"one worker @ {hi}"]["seconds"], ">=", 1.3))
    if len(counts) > 1:
        speedup, memory = lone[lo] / lone[hi], lone_triad[hi] / lone_triad[lo]
        out["lone_speedup"], out["triad_speedup"] = speedup, memory
        targets.append(check(f"a lone layer at {hi} threads / at {lo}", speedup, ">=", 1.7))
        targets.append(check(f"that speed-up / the triad's ({memory:.2f}x)", speedup / memory,
                             ">=", 0.9))
    out["targets"] = targets
    return out
