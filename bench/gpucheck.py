"""One command that proves the GPU path on a GPU machine: the CUDA tests (pytest -m cuda) and
the GPU benchmarks (bench/gpu.py), inside a time budget, into one JSON and one markdown table.

    python3 -m bench.gpucheck [--wheels DIR] [--out DIR] [--budget SECONDS] [--full]
                              [--only tests,transfer,...] [--share paper=380,...]
    make gpu-check WHEELS=DIR                                  (the same, with python3)

It needs no network: packages the machine's Python lacks (pyzmq, say) are installed from the
wheels in DIR into a temporary folder, for this run only. It runs from a checkout (nothing
installed). OUT receives three files only, rewritten as each part ends (a run killed midway
leaves what was done): gpu-check.json, gpu-check.md and gpu-check.log (every part's output).
Without CUDA it says so and exits 2 (``--tiny`` checks this harness on a CPU instead); it exits
1 if a test fails or a benchmark breaks (a missed target, or a piece stopped by the budget, is
reported, not a failure), else 0. The benchmarks run in order while the budget lasts, each
within its own share; a piece that cannot start in time is listed as not run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEEDS = ("torch", "zmq", "msgpack", "numpy", "uvloop", "safetensors", "yaml", "tqdm",
         "prometheus_client")
# Benchmark runs in order: (label, piece of bench/gpu.py, its options, its options when
# --full, seconds it needs at least to be worth starting, seconds it may take at most (not
# with --full)). DeepSpeed's peers come last in a piece: its CPU Adam is compiled at first use
# (cached on disk: the first piece that runs one pays for it).
PIECES = [("transfer", "transfer", [], [], 20, 60),
          ("engines", "engines", [], [], 20, 60),
          ("overhead", "overhead", [], [], 60, 120),
          ("paper", "paper", ["--seq", "128", "--u", "1,4", "--mbs", "0,32", "--steps", "2",
                              "--warmup", "1"], [], 120, 300),
          ("depth", "depth", ["--depths", "24,48,96"], [], 60, 120),
          ("fsdp2", "peers", ["--peers", "resident,fsdp2,fsdp2-noac"],
           ["--peers", "resident,fsdp2,fsdp2-noac,fsdp2-hostacc"], 90, 180),
          ("mfu", "mfu", ["--mfu-params", "4"], [], 90, 180),
          ("llama", "llama", [], [], 150, 300),
          ("hfpeers", "hfpeers", ["--hf-us", "4", "--peers",
                                  "resident,fsdp2,fsdp2-noac,deepspeed-offload"],
           ["--peers", "resident,fsdp2,fsdp2-noac,fsdp2-hostacc,deepspeed-offload"], 150, 420),
          # the same shape deeper than the resident model can hold (its row: out of memory)
          ("hfbig", "hfpeers", ["--hf-layers", "beyond", "--hf-us", "4", "--hf-budgets", "-1",
                                "--peers", "resident,fsdp2,deepspeed"],
           ["--hf-layers", "beyond", "--hf-us", "4,8", "--hf-budgets", "0,-1",
            "--peers", "resident,fsdp2,fsdp2-noac,deepspeed"], 240, 480),
          # a mixture of experts (OLMoE's shape, 6 layers: 2.7B, 0.6B active; the resident
          # model's states and activations fit 80 GB): the host's update per token is ~5x a
          # dense model's, so a larger u is measured too
          ("hfmoe", "hfpeers", ["--hf-arch", "olmoe", "--hf-layers", "6", "--hf-us", "4,16",
                                "--hf-budgets", "-1",
                                "--peers", "resident,fsdp2,deepspeed-offload"],
           ["--hf-arch", "olmoe", "--hf-layers", "6", "--hf-us", "4,16", "--hf-budgets", "0,-1",
            "--peers", "resident,fsdp2,fsdp2-noac,deepspeed-offload"], 240, 480),
          ("deepspeed", "peers", ["--peers", "deepspeed-offload,deepspeed"],
           ["--peers", "deepspeed-offload,deepspeed"], 120, 300)]
TINY = ["--tiny", "--device", "cpu", "--steps", "1", "--warmup", "1"]


class Check:
    """The report, written to OUT whenever a part ends; every part's output goes to one log."""

    def __init__(self, out: Path, work: Path, report: dict):
        self.out, self.work, self.report = out, work, report
        self.log = out / "gpu-check.log"
        self.log.write_text("")

    def save(self) -> None:
        for name, text in (("gpu-check.json", json.dumps(self.report, indent=1)),
                           ("gpu-check.md", markdown(self.report))):
            tmp = self.out / f".{name}"
            tmp.write_text(text)
            tmp.replace(self.out / name)

    def run(self, label: str, cmd: list[str], env: dict, timeout: float) -> tuple[int, bool, str]:
        """Run ``cmd`` for at most ``timeout`` seconds (then SIGINT to its process group, so
        pytest's fixtures and l2l-launch stop their processes, and SIGKILL 30 s later); its
        output is appended to the log. Returns (exit code, timed out, its whole output)."""
        part = self.work / f"{label}.log"
        with open(part, "w") as f:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                code, timed_out = proc.wait(timeout=max(timeout, 10)), False
            except subprocess.TimeoutExpired:
                stop_group(proc)
                code, timed_out = proc.wait(), True
            except BaseException:  # interrupted: its own session does not get the signal
                stop_group(proc)
                raise
        text = part.read_text(errors="replace")
        with open(self.log, "a") as f:
            f.write(f"===== {label}: {' '.join(cmd)}\n{text}\n===== {label}: exit {code}"
                    f"{' (stopped: time budget)' if timed_out else ''}\n\n")
        return code, timed_out, text


def stop_group(proc: subprocess.Popen) -> None:
    """SIGINT to the part's process group, SIGKILL 30 s later (or at a further interrupt)."""
    for sig, grace in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            continue


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.gpucheck", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wheels", default="", help="folder of wheels to install for this run")
    p.add_argument("--out", default="runs/gpu-check", help="results folder")
    p.add_argument("--budget", type=float, default=470, help="seconds for everything")
    p.add_argument("--full", action="store_true",
                   help="the whole paper table (T=128,512, u=1,2,4,8; largest and fixed "
                        "micro-batch) and 384 blocks")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--only", default="",
                   help="comma-separated parts to run: tests and/or benchmarks among "
                        + ", ".join(name for name, *_ in PIECES) + " (default: all)")
    p.add_argument("--share", default="",
                   help="NAME=SECONDS,...: a benchmark's time share instead of its default "
                        "(a long lease can give the paper table more than its 300 s)")
    p.add_argument("--tiny", action="store_true",
                   help="check this harness on a CPU: tiny models, the CUDA tests skip")
    a = p.parse_args(argv)
    known = {"tests", *(name for name, *_ in PIECES)}
    try:
        a.share = {k.strip(): float(v) for k, v in
                   (part.split("=") for part in a.share.split(",") if part.strip())}
    except ValueError:
        p.error(f"--share: expected NAME=SECONDS[,NAME=SECONDS], got {a.share!r}")
    pieces = {name for name, *_ in PIECES}
    if set(a.share) - pieces or any(v <= 0 for v in a.share.values()):
        p.error(f"--share: benchmarks are {', '.join(sorted(pieces))}, with seconds > 0; "
                f"got {a.share}")
    a.only = {part.strip() for part in a.only.split(",") if part.strip()} or known
    if a.only - known:
        p.error(f"--only: unknown part(s) {', '.join(sorted(a.only - known))}; "
                f"known: {', '.join(sorted(known))}")
    if a.skip_tests:
        a.only.discard("tests")
    if not a.only:
        p.error("nothing to run: --skip-tests left no part of --only")
    t0 = time.monotonic()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="l2l-gpucheck-"))
    signal.signal(signal.SIGTERM, interrupted)  # stop the running part, keep the report
    try:
        return check(a, t0, out, work)
    except KeyboardInterrupt:
        print(f"gpu-check: interrupted; the report in {out} has the parts that ended",
              file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(work, ignore_errors=True)


def interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def check(a, t0: float, out: Path, work: Path) -> int:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths, wheels = [str(ROOT)], {}
    if a.wheels:
        wheels = install_wheels(Path(a.wheels), work / "site")
        if wheels is None:
            return 2
        paths.insert(0, str(work / "site"))
        sys.path[:0] = [str(work / "site")]
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

    cuda = torch.cuda.is_available()
    if not cuda and not a.tiny:
        why = "was built without CUDA" if torch.version.cuda is None else "sees no GPU"
        print(f"gpu-check: no CUDA device here: torch {torch.__version__} ({sys.executable}) "
              f"{why}. Nothing was checked.", file=sys.stderr)
        return 2
    c = Check(out, work, {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (--tiny: harness check)",
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": sys.version.split()[0], "gpus": torch.cuda.device_count(),
        "cpus": os.cpu_count(), "budget_seconds": a.budget, "wheels": wheels,
        "tests": {"not_run": "not yet"}, "benchmarks": {}, "seconds": 0.0})
    if cuda:  # where this is False the worker maps the weights writable to pin them
        from worker.streams import read_only_registration_supported

        c.report["read_only_registration"] = read_only_registration_supported(
            torch.device("cuda:0"))
    c.save()
    print(f"gpu-check: {c.report['device']}, torch {c.report['torch']} (CUDA "
          f"{c.report['cuda']}), budget {a.budget:.0f} s", flush=True)
    left = lambda: a.budget - (time.monotonic() - t0)  # noqa: E731
    pieces = [(name, piece, quick, whole, need, a.share.get(name, cap))
              for name, piece, quick, whole, need, cap in PIECES if name in a.only]
    if "tests" not in a.only:
        c.report["tests"] = {"not_run": "not asked for (--skip-tests or --only)"}
    elif not importable("pytest"):
        c.report["tests"] = {"not_run": f"{sys.executable} has no pytest"}
    else:
        keep = min(220, sum(cap for *_, cap in pieces)) + 10  # seconds for the benchmarks
        c.report["tests"] = guarded(lambda: run_tests(c, env, min(left() - keep, 240), a.tiny))
    c.report["seconds"] = round(time.monotonic() - t0, 1)
    c.save()
    for name, piece, quick, whole, need, cap in pieces:
        if left() < need:
            c.report["benchmarks"][name] = {"not_run": f"time budget ({left():.0f} s left, "
                                                       f"needs ~{need})"}
        else:
            opts = (whole if a.full else quick) + (TINY if a.tiny else [])
            timeout = left() - 5 if a.full else min(left() - 5, cap)
            c.report["benchmarks"][name] = guarded(
                lambda: run_piece(c, env, name, piece, opts, timeout))
        c.report["seconds"] = round(time.monotonic() - t0, 1)
        c.save()
    print((out / "gpu-check.md").read_text())
    print(f"gpu-check: wrote {out / 'gpu-check.json'}, {out / 'gpu-check.md'} and "
          f"{c.log}")
    t = c.report["tests"]
    broken = (t.get("failed", 0) + t.get("errors", 0) + ("broken" in t) + ("error" in t)
              + sum("error" in b for b in c.report["benchmarks"].values()))
    return 1 if broken else 0


def guarded(part) -> dict:
    """A part's result; a bug in this harness costs that part, not the report."""
    try:
        return part()
    except Exception as e:
        print(f"gpu-check: harness error: {type(e).__name__}: {e}", file=sys.stderr)
        return {"error": f"gpu-check itself failed: {type(e).__name__}: {e}"[:2000]}


def importable(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except Exception:
        return False


def install_wheels(folder: Path, site: Path) -> dict | None:
    """Install each wheel on its own (a wheel that will not install costs itself only; the
    check of the needed modules says if it mattered). None if there is none."""
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        print(f"gpu-check: no wheels in {folder}", file=sys.stderr)
        return None
    done = {}
    for w in wheels:
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                            "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
                            "--target", str(site), str(w)], capture_output=True, text=True)
        done[w.name] = "installed" if r.returncode == 0 else f"failed: {r.stderr[-500:]}"
        if r.returncode:
            print(f"gpu-check: installing {w.name} failed:\n{r.stderr[-1000:]}",
                  file=sys.stderr)
    print(f"gpu-check: installed {sum(v == 'installed' for v in done.values())} of "
          f"{len(wheels)} wheels into {site}", flush=True)
    return done


def run_tests(c: Check, env: dict, timeout: float, tiny: bool) -> dict:
    """pytest -m cuda, in up to 8 processes where pytest-xdist is at hand (each test starts its own
    EPS and workers; several share the GPU)."""
    xml = c.work / "cuda-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-v", "-rs", "-p", "no:cacheprovider",
           "-p", "no:benchmark",  # GPU images may have pytest-benchmark: a warning per process
           f"--junitxml={xml}", str(ROOT / "tests" / "test_cuda.py")]
    cpus = os.cpu_count() or 1
    if importable("xdist") and cpus >= 8 and not tiny:  # else one process
        cmd[3:3] = ["-n", str(min(8, cpus // 2))]
    t = time.monotonic()
    code, timed_out, log = c.run("cuda-tests", cmd, dict(env, OMP_NUM_THREADS="1"), timeout)
    result = {"seconds": round(time.monotonic() - t, 1), "exit": code, "timed_out": timed_out,
              "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "cases": []}
    cases = junit_cases(xml) if xml.exists() else verbose_cases(log)
    for case in cases:
        result[case["outcome"]] += 1
    result["cases"] = cases
    if timed_out:
        result["stopped"] = f"stopped after {timeout:.0f} s; tests not listed did not run"
    elif (code not in (0, 1) or not xml.exists()  # crashed, interrupted, or collected nothing
          or code == 1 and not result["failed"] + result["errors"]):  # leaked shared memory
        result["broken"] = f"pytest exit {code}{'' if xml.exists() else ', no report'}: " + \
            log[-1500:]
    print(f"gpu-check: tests {result['passed']} passed, {result['failed']} failed, "
          f"{result['errors']} errors, {result['skipped']} skipped in {result['seconds']} s"
          + (" (stopped)" if timed_out else "") + (" (BROKEN)" if "broken" in result else ""),
          flush=True)
    return result


def junit_cases(xml: Path) -> list[dict]:
    cases = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "errors"}.get(tag, tag)
                message = (el.get("message") or "")[:300]
        cases.append({"name": case.get("name"), "outcome": outcome,
                      "seconds": float(case.get("time") or 0), "message": message})
    return cases


def verbose_cases(log: str) -> list[dict]:
    """Outcomes from ``pytest -v`` lines, when pytest left no report (killed)."""
    outcomes = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped"}
    found = {}
    for m in re.finditer(r"test_cuda\.py::(\S+)\s+(PASSED|FAILED|ERROR|SKIPPED)|"
                         r"(PASSED|FAILED|ERROR|SKIPPED)\s+\S*test_cuda\.py::(\S+)", log):
        name, word = (m[1], m[2]) if m[1] else (m[4], m[3])
        found[name] = outcomes[word]
    return [{"name": n, "outcome": o, "seconds": 0.0, "message": "(from the log)"}
            for n, o in found.items()]


def run_piece(c: Check, env: dict, name: str, piece: str, opts: list[str],
              timeout: float) -> dict:
    path = c.work / f"bench-{name}.json"
    cmd = [sys.executable, "-m", "bench", "gpu", "--only", piece, "--json", str(path), *opts]
    t = time.monotonic()
    code, timed_out, log = c.run(f"bench-{name}", cmd, env, timeout)
    if path.exists():  # also when stopped: the piece keeps the rows it measured
        data = json.loads(path.read_text())["pieces"][piece]
    elif timed_out:
        data = {"stopped": "stopped at the end of its time share, nothing written",
                "rows": [], "table": f"{name}: STOPPED before it wrote anything"}
    else:
        data = {"error": f"exit {code}: {log[-1500:]}"}
    data["wall_seconds"] = round(time.monotonic() - t, 1)
    note = data.get("error") or data.get("stopped") or ""
    print(f"gpu-check: {name} done in {data['wall_seconds']} s"
          + (f" ({note[:200]})" if note else ""), flush=True)
    return data


def markdown(report: dict) -> str:
    t = report["tests"]
    lines = [f"# GPU check: {report['device']}, torch {report['torch']} (CUDA "
             f"{report['cuda']}), {report['seconds']} s", ""]
    if "not_run" in t or "error" in t:
        lines += [f"**CUDA tests**: {t.get('not_run') or 'ERROR: ' + t['error']}", ""]
    else:
        lines += [f"**CUDA tests**: {t['passed']} passed, {t['failed']} failed, "
                  f"{t['errors']} errors, {t['skipped']} skipped in {t['seconds']} s"
                  + (f" ({t['stopped']})" if "stopped" in t else ""), ""]
        if "broken" in t:
            lines += ["BROKEN: ```" + t["broken"][-600:] + "```", ""]
    lines += [f"- {c['outcome'].upper()} `{c['name']}`: {c['message']}"
              for c in t.get("cases", []) if c["outcome"] != "passed"]
    lines += ["", "| benchmark | target | value | result |", "| --- | --- | --- | --- |"]
    for name, b in report["benchmarks"].items():
        for key, word in (("not_run", "not run: "), ("stopped", "STOPPED: "),
                          ("error", "ERROR: "), ("skipped", "skipped: ")):
            if key in b:
                lines.append(f"| {name} | | | {word}{b[key][-150:]} |".replace("\n", " "))
        for tg in b.get("targets", []):
            lines.append(f"| {name} | {tg['name']} {tg['target']} | {tg['value']} | "
                         f"{'pass' if tg['ok'] else 'MISS'} |")
    for name, b in report["benchmarks"].items():
        if b.get("table"):
            lines += ["", f"## {name}", "", "```", b["table"], "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
