"""Several boxes on loopback: ``python -m bench multibox``. Each "box" is an l2l-launch with
its own EPS and workers, the EPSes joined by gloo (--nodes); against one box with the same
total workers, in the same run: the step time, the engines' time spent in the cross-box
reductions (turn waits included: what the overlap must hide), and the EPS's host bytes per
parameter on each box (replicate mode: every box holds everything).

On this 2-core machine the boxes share the cores, so the ratio mixes the reduction's cost
with contention; docs/multibox.md estimates the overlap on real links from per-layer figures.
"""

from __future__ import annotations

import argparse
import socket
from concurrent.futures import ThreadPoolExecutor

from .common import l2l_job, steady_step_seconds, table


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--boxes", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def multibox(a) -> dict:
    model = ["--model", "bert", "--layers", str(a.layers), "--hidden", str(a.hidden),
             "--heads", "4", "--seq-len", "64", "--micro-batch-size", "8",
             "--micro-batches", "2", "--threads", "1", "--server-threads", "1"]
    one = l2l_job(model, workers=a.boxes, steps=a.steps)
    port = str(_port())

    def box(r: int) -> dict:
        return l2l_job(model, workers=1, steps=a.steps,
                       extra=["--nodes", str(a.boxes), "--node-rank", str(r),
                              "--master-port", port])

    with ThreadPoolExecutor(a.boxes) as pool:
        several = list(pool.map(box, range(a.boxes)))
    t_one = steady_step_seconds(one, a.warmup)
    t_box = max(steady_step_seconds(s, a.warmup) for s in several)
    params = one["eps"]["params"]
    reduce_per_step = max(s["eps"].get("box_reduce_seconds", 0.0) for s in several) / a.steps
    rows = [["1 box x {} workers: s/step".format(a.boxes), t_one],
            [f"{a.boxes} boxes x 1 worker: s/step (slowest box)", t_box],
            ["ratio (several boxes / one box)", t_box / t_one],
            ["cross-box reductions, engine seconds/step (slowest box)", reduce_per_step],
            ["fp32 gradient bytes all-reduced per step per box (MB)", 4 * params / 1e6],
            ["EPS bytes/param held, one box", one["eps"].get("bytes_per_param", 0.0)],
            *[[f"EPS bytes/param held, box {r} (replicate)", s["eps"].get("bytes_per_param",
                                                                            0.0)]
              for r, s in enumerate(several)]]
    print(table(f"multibox: BERT L={a.layers} H={a.hidden} ({params / 1e6:.1f}M params), "
                f"T=64 u=2 B=8, replicate, loopback gloo", ["", "value"], rows))
    return {"params": params, "one_box_step_seconds": t_one, "boxes_step_seconds": t_box,
            "ratio": t_box / t_one, "box_reduce_seconds_per_step": reduce_per_step,
            "targets": []}  # the figures are read against the paper estimate (README)
