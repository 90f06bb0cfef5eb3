"""l2l-launch: start one eps-server and N l2l-workers on this box and train.

    l2l-launch --workers 2 --model bert --layers 8 --steps 50 --summary-json run.json

Options shared with eps-server and l2l-worker keep their names and meaning there.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time

from eps_server.__main__ import add_optimizer_args, optimizer_argv
from eps_server.config import PRECISIONS
from protocol.trace import merge
from worker.cli import add_job_args, add_model_args, job_argv

from .launcher import Launcher, private_run_dir


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="l2l-launch", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workers", type=int, default=1, help="worker processes (one per device)")
    p.add_argument("--endpoint", default="", help="default: a private ipc socket for this run")
    p.add_argument("--summary-json", default="", help="write the run summary here")
    p.add_argument("--save", default="", help="write the trained model here (safetensors)")
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32")
    p.add_argument("--server-threads", type=int, default=1)
    p.add_argument("--server-save", default="", help="EPS checkpoint directory (at exit)")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--load", default="", help="EPS checkpoint to resume from")
    p.add_argument("--trace", default="", help="write one Chrome/Perfetto trace of all "
                   "processes here (render: python -m bench.timeline TRACE --png OUT)")
    p.add_argument("--quiet", action="store_true", help="hide the children's logs")
    add_model_args(p)
    add_job_args(p)
    add_optimizer_args(p)
    return p


def worker_device(device: str, rank: int) -> str:
    """--device cuda spreads workers over GPUs (rank r on cuda:r); cpu and cuda:K are kept."""
    return f"cuda:{rank}" if device == "cuda" else device


def build(a: argparse.Namespace) -> Launcher:
    run_id = secrets.token_hex(4)
    run_dir = private_run_dir()
    endpoint = a.endpoint or f"ipc://{run_dir}/eps.sock"
    py = sys.executable
    server = [py, "-m", "eps_server", "--endpoint", endpoint, "--world-size", str(a.workers),
              "--run-id", run_id, "--exit-when-done", "--precision", a.precision,
              "--server-threads", str(a.server_threads), *optimizer_argv(a)]
    if a.server_save:
        server += ["--server-save", a.server_save, "--checkpoint-every", str(a.checkpoint_every)]
    if a.load:
        server += ["--load", a.load]
    if a.trace:
        server += ["--trace", os.path.join(run_dir, "trace-eps.json")]
    workers = []
    for rank in range(a.workers):
        argv = [py, "-m", "worker", "--endpoint", endpoint, "--rank", str(rank),
                "--world-size", str(a.workers), *job_argv(a),
                "--summary-json", os.path.join(run_dir, f"worker-{rank}.json")]
        argv[argv.index("--device") + 1] = worker_device(a.device, rank)
        if rank == 0 and a.save:
            argv += ["--save", os.path.abspath(a.save)]
        if a.trace:
            argv += ["--trace", os.path.join(run_dir, f"trace-w{rank}.json")]
        workers.append(argv)
    return Launcher(server, workers, run_id, run_dir, a.steps, quiet=a.quiet)


def summarize(a: argparse.Namespace, launcher: Launcher, code: int, elapsed: float) -> dict:
    ranks = []
    for r in range(a.workers):
        try:
            with open(os.path.join(launcher.run_dir, f"worker-{r}.json")) as f:
                ranks.append(json.load(f))
        except (OSError, ValueError):
            pass
    complete = len(ranks) == a.workers
    losses = [sum(w["losses"][i] for w in ranks) for i in range(ranks[0]["steps"])] \
        if complete and ranks else [p["loss"] for p in launcher.progress]
    accuracy = [sum(w["correct"][i] for w in ranks) / max(1, sum(w["counts"][i] for w in ranks))
                for i in range(ranks[0]["steps"])] if complete and ranks else []
    samples = sum(w["samples"] for w in ranks)
    seconds = max((w["seconds"] for w in ranks), default=0.0)
    return {
        "ok": code == 0, "exit_code": code, "failure": launcher.failure,
        "run_id": launcher.run_id, "world_size": a.workers,
        "steps": len(losses), "first_step": ranks[0]["first_step"] if ranks else None,
        "losses": losses, "accuracy": accuracy,
        "samples_per_sec": samples / seconds if seconds > 0 else 0.0,
        "elapsed_seconds": elapsed,
        "workers": [{"rank": w["rank"], "device": w["device"],
                     "peak_memory_bytes": w["peak_memory_bytes"],
                     "samples_per_sec": w["samples_per_sec"],
                     "step_seconds": w["step_seconds"],
                     "fetches_without_round_trip": w["fetches_without_round_trip"]}
                    for w in ranks],
        "model": {k: getattr(a, k) for k in ("model", "layers", "hidden", "heads", "seq_len",
                                              "vocab", "dropout", "seed")},
        "job": {k: getattr(a, k) for k in ("micro_batches", "micro_batch_size", "device",
                                            "precision", "optimizer", "lr", "transport")},
        "save": os.path.abspath(a.save) if a.save and code == 0 else None,
        "eps": launcher.eps_stats,
    }


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.workers < 1:
        print("l2l-launch: --workers must be >= 1", file=sys.stderr)
        return 2
    launcher = build(a)
    t0 = time.perf_counter()
    try:
        code = launcher.run()
        summary = summarize(a, launcher, code, time.perf_counter() - t0)
        if a.trace:
            parts = ["trace-eps.json"] + [f"trace-w{r}.json" for r in range(a.workers)]
            merge([os.path.join(launcher.run_dir, p) for p in parts], a.trace)
    finally:
        launcher.cleanup()
    if code == 0:
        peak = max((w["peak_memory_bytes"] for w in summary["workers"]), default=0)
        final = summary["losses"][-1] if summary["losses"] else float("nan")
        print(f"done: {summary['steps']} steps, final loss {final:.4f}, "
              f"{summary['samples_per_sec']:,.1f} samples/s, peak worker memory "
              f"{peak / 2**20:.0f} MiB", flush=True)
    else:
        print(f"l2l-launch: failed: {launcher.failure}", file=sys.stderr, flush=True)
    if a.summary_json:
        with open(a.summary_json, "w") as f:
            json.dump(summary, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())
