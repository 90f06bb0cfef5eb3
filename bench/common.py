"""Shared pieces of the benchmarks: running L2L jobs, timing, tables, JSON.

Every figure a benchmark reports is a ratio against a baseline measured in the same run, side
by side (these machines are noisy); times are medians over steady-state steps.
"""

from __future__ import annotations

import glob
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def machine() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "platform": platform.platform(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def l2l_job(model_args: list[str], *, workers: int = 1, steps: int, extra=(), server=(),
            timeout: float = 3600) -> dict:
    """Run ``l2l-launch`` (real processes) and return its summary (with per-worker
    ``step_seconds`` and ``peak_memory_bytes``). A failure's error holds the end of every
    process's log (read before the run's folder goes: out-of-memory is told by it)."""
    with tempfile.TemporaryDirectory(prefix="l2l-bench-") as tmp:
        summary, runs = os.path.join(tmp, "summary.json"), os.path.join(tmp, "runs")
        argv = [sys.executable, "-m", "launch", "--runs-dir", runs, "--workers", str(workers),
                "--steps", str(steps), "--summary-json", summary, *model_args, *extra, *server]
        with open(os.path.join(tmp, "console.log"), "w+") as console:
            p = subprocess.Popen(argv, env=ENV, stdout=console, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL)
            try:
                code = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                stop_launcher(p, signal_it=True)
                raise
            except BaseException:  # interrupted: the SIGINT reached the launcher too
                stop_launcher(p, signal_it=False)
                # where it was: a job stopped by a time budget says nothing else
                print(f"l2l-launch interrupted; its output:\n{job_output(console, runs, 20)}",
                      file=sys.stderr, flush=True)
                raise
            if code != 0:
                raise RuntimeError(f"l2l-launch failed ({code}):\n{job_output(console, runs)}")
        with open(summary) as f:
            return json.load(f)


def stop_launcher(p: subprocess.Popen, signal_it: bool, grace: float = 20.0) -> None:
    """Let l2l-launch stop its processes and unlink their memory (``signal_it``: send it the
    SIGINT first), SIGKILL after ``grace`` s. An interrupt meanwhile does not cut the wait
    short; it is raised once the launcher is gone."""
    if signal_it and p.poll() is None:
        p.send_signal(signal.SIGINT)
    deadline, interrupted = time.monotonic() + grace, False
    while True:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
            break
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            break
        except KeyboardInterrupt:
            interrupted = True
    if interrupted and signal_it:
        raise KeyboardInterrupt


def job_output(console, runs: str, lines: int = 40) -> str:
    """The end of a job's console and of each of its processes' logs."""
    console.seek(0)
    return console.read()[-3000:] + log_tails(runs, lines)


def log_tails(folder: str, lines: int = 40) -> str:
    """The last ``lines`` lines of every ``*.log`` under ``folder``."""
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "**", "*.log"), recursive=True)):
        with open(path, errors="replace") as f:
            tail = f.read().splitlines()[-lines:]
        out.append(f"\n--- {os.path.relpath(path, folder)} (last {len(tail)} lines)\n"
                   + "\n".join(tail))
    return "".join(out)


def steady_step_seconds(summary: dict, warmup: int) -> float:
    """Median step time after ``warmup`` steps, slowest worker per step."""
    per_worker = [w["step_seconds"][warmup:] for w in summary["workers"]]
    return median([max(steps) for steps in zip(*per_worker)])


def sync(device) -> None:
    """Wait for queued device work (CUDA kernels are asynchronous)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(step_fn, steps: int, warmup: int, device="cpu") -> float:
    """Median seconds of ``step_fn(i)`` over ``steps`` calls after ``warmup`` calls."""
    times = []
    for i in range(warmup + steps):
        sync(device)
        t0 = time.perf_counter()
        step_fn(i)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return median(times)


def interleaved(contenders: dict, reps: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds of each ``name -> fn()``, timed in rounds that call every contender once
    (so the machine's slow and fast moments fall on all of them alike)."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for rep in range(warmup + reps):
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            fn()
            if rep >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: median(ts) for name, ts in times.items()}


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def table(title: str, headers: list[str], rows: list[list]) -> str:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [title, line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                      enumerate(zip(row, widths))) for row in cells]
    return "\n".join(out)


class LiveRows(list):
    """A table's rows, each printed as it is added: a piece can take minutes, and one stopped
    midway has shown what it measured."""

    def __init__(self, headers: list[str]):
        super().__init__()
        self.headers = headers
        print("  ".join(headers), flush=True)

    def append(self, row: list) -> None:
        super().append(row)
        print("  ".join(_fmt(c) for c in row), flush=True)


def _fmt(c) -> str:
    if isinstance(c, float):
        return f"{c:,.3f}" if abs(c) < 100 else f"{c:,.0f}"
    return str(c)


def check(name: str, value: float, op: str, target: float) -> dict:
    ok = value >= target if op == ">=" else value <= target
    return {"name": name, "value": round(value, 4), "target": f"{op} {target}", "ok": ok}


def report(result: dict, path: str | None) -> None:
    print(result.get("table", ""))
    for t in result.get("targets", []):
        mark = "PASS" if t["ok"] else "MISS"
        print(f"  [{mark}] {t['name']}: {t['value']} (target {t['target']})")
    if path:
        with open(path, "w") as f:
            json.dump({k: v for k, v in result.items() if k != "table"} | {"machine": machine()},
                      f, indent=1)
