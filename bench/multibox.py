"""Several boxes on loopback: ``python -m bench multibox``. Each "box" is an l2l-launch with
its own EPS and workers, the EPSes joined by gloo (--nodes); for each number of boxes N and
each ``--eps-mode``, against one box with the same total workers, in the same run: the step
time, the engines' time in the cross-box collectives (turn waits included: what the overlap
must hide), and the EPS's host memory per parameter on each box: ``held`` (master, optimizer
state, served copy: replicate keeps ~16 B/param in fp32 on every box, shard 4 + 12/N) and
with the transient gradient buffers at their peak. With ``--overlap off`` the same runs have
their workers wait for each pushed layer's update (--no-overlap): the cross-box reduction is
then exposed in full, where L2Lp hides it behind the backward of the layers below.

On this 2-core machine the boxes share the cores, so the ratio mixes the collectives' cost
with contention; docs/multibox.md estimates the overlap on real links from per-layer figures.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

from .common import free_port, l2l_job, steady_step_seconds, table


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--boxes", default="2,3", help="numbers of boxes, comma-separated")
    p.add_argument("--modes", default="replicate,shard")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--overlap", default="on,off",
                   help="on: L2Lp (a layer's cross-box reduction hidden behind the backward of "
                        "the layers below); off: workers wait for each push's update "
                        "(--no-overlap), so every reduction is exposed")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)


def _held(summary: dict) -> float:
    eps = summary["eps"]
    return eps.get("model_bytes", 0) / max(1, eps["params"])


def multibox(a) -> dict:
    model = ["--model", "bert", "--layers", str(a.layers), "--hidden", str(a.hidden),
             "--heads", "4", "--seq-len", "64", "--micro-batch-size", "8",
             "--micro-batches", "2", "--threads", "1", "--server-threads", "1"]
    counts = [int(n) for n in str(a.boxes).split(",")]
    modes = [m for m in a.modes.split(",") if m]
    rows, out = [], {"targets": []}  # the figures are read against the estimate (docs)
    for n, overlap in ((n, o) for o in a.overlap.split(",") for n in counts):
        serial = ["--no-overlap"] if overlap == "off" else []
        said = ", no overlap" if serial else ""
        one = l2l_job(model + serial, workers=n, steps=a.steps)
        t_one = steady_step_seconds(one, a.warmup)
        params = one["eps"]["params"]
        rows.append([f"1 box x {n} workers{said}", f"{t_one:.3f}", "1.00", "-", "-",
                     f"{_held(one):.2f}", f"{one['eps'].get('bytes_per_param', 0.0):.2f}"])
        out[f"one_box_{n}{'_serial' if serial else ''}_step_seconds"] = t_one
        for mode in modes:
            port = str(free_port())

            def box(r: int, n=n, mode=mode, port=port, serial=serial) -> dict:
                return l2l_job(model + serial, workers=1, steps=a.steps,
                               extra=["--nodes", str(n), "--node-rank", str(r),
                                      "--master-port", port, "--eps-mode", mode])

            with ThreadPoolExecutor(n) as pool:
                several = list(pool.map(box, range(n)))
            t_box = max(steady_step_seconds(s, a.warmup) for s in several)
            reduce_ = max(s["eps"].get("box_reduce_seconds", 0.0) for s in several) / a.steps
            gather = max(s["eps"].get("box_gather_seconds", 0.0) for s in several) / a.steps
            held = max(_held(s) for s in several)
            peak = max(s["eps"].get("bytes_per_param", 0.0) for s in several)
            rows.append([f"{n} boxes x 1 worker, {mode}{said}", f"{t_box:.3f}",
                         f"{t_box / t_one:.2f}", f"{reduce_:.3f}", f"{gather:.3f}",
                         f"{held:.2f}", f"{peak:.2f}"])
            out[f"{mode}_{n}{'_serial' if serial else ''}"] = {
                                  "step_seconds": t_box, "ratio": t_box / t_one,
                                  "reduce_seconds_per_step": reduce_,
                                  "gather_seconds_per_step": gather,
                                  "held_bytes_per_param": held, "peak_bytes_per_param": peak}
    print(table(f"multibox: BERT L={a.layers} H={a.hidden} ({params / 1e6:.1f}M params), T=64 "
                "u=2 B=8, fp32, loopback gloo; engine seconds per step in cross-box "
                "collectives and EPS bytes/param are the worst box's",
                ["", "s/step", "ratio to 1 box", "reduce s", "gather s", "held B/param",
                 "with buffers B/param"], rows))
    return {"params": params, **out}
