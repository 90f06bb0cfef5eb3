"""One command that proves the GPU path on a GPU machine: the CUDA tests (pytest -m cuda) and
the GPU benchmarks (bench/gpu.py), inside a time budget, into one JSON and one markdown table.

    python3 -m bench.gpucheck [--wheels DIR] [--out DIR] [--budget SECONDS] [--full]
    make gpu-check WHEELS=DIR                                  (the same, with python3)

It needs no network: packages the machine's Python lacks (pyzmq, say) are installed from the
wheels in DIR into OUT/site, for this run only. It runs from a checkout (nothing installed).
Without CUDA it says so and exits 2; it exits 1 if a test fails or a benchmark breaks (a
benchmark target missed is reported, not a failure), else 0. The benchmarks run in order
while the budget lasts; a piece that cannot start in time is listed as not run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEEDS = ("torch", "zmq", "msgpack", "numpy", "uvloop", "safetensors", "numba", "yaml", "tqdm",
         "rich", "prometheus_client", "pytest")
# Benchmark runs in order: (label, piece of bench/gpu.py, its options, its options when
# --full, the seconds it needs at least to be worth starting). DeepSpeed comes last: its
# CPU Adam is compiled at first use.
PIECES = [("transfer", "transfer", [], [], 20),
          ("overhead", "overhead", [], [], 60),
          ("paper", "paper", ["--seq", "128", "--u", "1,4"], [], 120),
          ("depth", "depth", ["--depths", "24,48,96"], [], 60),
          ("fsdp2", "peers", ["--peers", "fsdp2"], ["--peers", "fsdp2"], 60),
          ("mfu", "mfu", [], [], 90),
          ("deepspeed", "peers", ["--peers", "deepspeed"], ["--peers", "deepspeed"], 120)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.gpucheck", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wheels", default="", help="folder of wheels to install for this run")
    p.add_argument("--out", default="runs/gpu-check", help="results folder")
    p.add_argument("--budget", type=float, default=470, help="seconds for everything")
    p.add_argument("--full", action="store_true",
                   help="the whole paper table (T=128,512, u=1,2,4,8) and 384 blocks")
    p.add_argument("--skip-tests", action="store_true")
    a = p.parse_args(argv)
    t0 = time.monotonic()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    paths = [str(ROOT)]
    if a.wheels:
        site = install_wheels(Path(a.wheels), out / "site")
        if site is None:
            return 2
        paths.insert(0, str(site))
        sys.path[:0] = [str(site)]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    sys.path.insert(0, str(ROOT))
    missing = [m for m in NEEDS if not importable(m)]
    if "torch" in missing:
        print(f"gpu-check: {sys.executable} has no torch; run it with the Python that has "
              "torch with CUDA (make gpu-check PYTHON=...)", file=sys.stderr)
        return 2
    if missing:
        print(f"gpu-check: {sys.executable} lacks {', '.join(missing)}; put their wheels in a "
              "folder and pass it (make gpu-check WHEELS=DIR; README: 'The GPU check')",
              file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        why = "was built without CUDA" if torch.version.cuda is None else "sees no GPU"
        print(f"gpu-check: no CUDA device here: torch {torch.__version__} ({sys.executable}) "
              f"{why}. Nothing was checked.", file=sys.stderr)
        return 2
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "cuda": torch.version.cuda, "python": sys.version.split()[0],
              "gpus": torch.cuda.device_count(), "budget_seconds": a.budget}
    print(f"gpu-check: {report['device']}, torch {report['torch']} (CUDA {report['cuda']}), "
          f"budget {a.budget:.0f} s", flush=True)
    left = lambda: a.budget - (time.monotonic() - t0)  # noqa: E731
    report["tests"] = ({"skipped": "--skip-tests"} if a.skip_tests else
                       run_tests(out, env, min(left() - 180, 300)))
    report["benchmarks"] = run_benchmarks(out, env, left, a.full)
    report["seconds"] = round(time.monotonic() - t0, 1)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1))
    (out / "gpu-check.md").write_text(markdown(report))
    print((out / "gpu-check.md").read_text())
    print(f"gpu-check: wrote {out / 'gpu-check.json'} and {out / 'gpu-check.md'}")
    broken = report["tests"].get("failed", 0) + report["tests"].get("errors", 0) + sum(
        1 for b in report["benchmarks"].values() if "error" in b)
    return 1 if broken or report["tests"].get("timed_out") else 0


def importable(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except Exception:
        return False


def install_wheels(folder: Path, site: Path) -> Path | None:
    wheels = sorted(str(w) for w in folder.glob("*.whl"))
    if not wheels:
        print(f"gpu-check: no wheels in {folder}", file=sys.stderr)
        return None
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site),
                        *wheels], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"gpu-check: installing the wheels of {folder} failed:\n{r.stderr[-2000:]}",
              file=sys.stderr)
        return None
    print(f"gpu-check: installed {len(wheels)} wheels into {site}", flush=True)
    return site


def run_bounded(cmd: list[str], env: dict, timeout: float, log: Path) -> tuple[int, bool]:
    """Run ``cmd`` (output to ``log``) for at most ``timeout`` seconds; past it, its process
    group gets SIGINT (pytest's fixtures and l2l-launch stop their processes on it), then
    SIGKILL 30 s later. Returns (exit code, timed out)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            return proc.wait(timeout=max(timeout, 10)), False
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            return proc.wait(), True


def run_tests(out: Path, env: dict, timeout: float) -> dict:
    xml = out / "cuda-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider",
           f"--junitxml={xml}", str(ROOT / "tests" / "test_cuda.py")]
    t = time.monotonic()
    _, timed_out = run_bounded(cmd, env, timeout, out / "cuda-tests.log")
    result = {"seconds": round(time.monotonic() - t, 1), "timed_out": timed_out,
              "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "cases": []}
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            outcome, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome = {"failure": "failed", "error": "errors"}.get(tag, tag)
                    message = (el.get("message") or "")[:300]
            result[outcome] += 1
            result["cases"].append({"name": case.get("name"), "outcome": outcome,
                                    "seconds": float(case.get("time") or 0),
                                    "message": message})
    print(f"gpu-check: tests {result['passed']} passed, {result['failed']} failed, "
          f"{result['errors']} errors, {result['skipped']} skipped in {result['seconds']} s"
          + (" (timed out)" if timed_out else ""), flush=True)
    return result


def run_benchmarks(out: Path, env: dict, left, full: bool) -> dict:
    results = {}
    for name, piece, quick, whole, need in PIECES:
        if left() < need:
            results[name] = {"not_run": f"time budget ({left():.0f} s left, needs ~{need})"}
            continue
        path = out / f"bench-{name}.json"
        cmd = [sys.executable, "-m", "bench", "gpu", "--only", piece, "--json", str(path),
               *(whole if full else quick)]
        t = time.monotonic()
        log = out / f"bench-{name}.log"
        code, timed_out = run_bounded(cmd, env, left() - 5, log)
        if timed_out:
            data = {"error": "stopped at the end of the time budget"}
        elif path.exists():
            data = json.loads(path.read_text())["pieces"][piece]
        else:
            data = {"error": f"exit {code}: {log.read_text()[-500:]}"}
        data["wall_seconds"] = round(time.monotonic() - t, 1)
        results[name] = data
        print(f"gpu-check: {name} done in {data['wall_seconds']} s"
              + (f" ({data['error'][:200]})" if "error" in data else ""), flush=True)
    return results


def markdown(report: dict) -> str:
    t = report["tests"]
    lines = [f"# GPU check: {report['device']}, torch {report['torch']} (CUDA "
             f"{report['cuda']}), {report['seconds']} s", "",
             f"**CUDA tests**: {t.get('passed', 0)} passed, {t.get('failed', 0)} failed, "
             f"{t.get('errors', 0)} errors, {t.get('skipped', 0)} skipped"
             + (" (timed out)" if t.get("timed_out") else ""), ""]
    lines += [f"- {c['outcome'].upper()} `{c['name']}`: {c['message']}"
              for c in t.get("cases", []) if c["outcome"] != "passed"]
    lines += ["", "| benchmark | target | value | result |", "| --- | --- | --- | --- |"]
    for name, b in report["benchmarks"].items():
        if "not_run" in b or "error" in b:
            lines.append(f"| {name} | | | {b.get('not_run') or 'ERROR: ' + b['error'][:150]} |")
        for tg in b.get("targets", []):
            lines.append(f"| {name} | {tg['name']} {tg['target']} | {tg['value']} | "
                         f"{'pass' if tg['ok'] else 'MISS'} |")
    for name, b in report["benchmarks"].items():
        if b.get("table"):
            lines += ["", f"## {name}", "", "```", b["table"], "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
