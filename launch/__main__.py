"""l2l-launch: start one eps-server and N l2l-workers on this box and train.

    l2l-launch --workers 2 --model bert --layers 8 --steps 50 --summary-json run.json

Options shared with eps-server and l2l-worker keep their names and meaning there (they are the
same config fields, launch/config.py); each child gets its typed config as a file.
``--role eps|worker`` runs one part of the job in the foreground instead (containers,
launch/roles.py); ``--plan`` prints the shared memory the job's EPS needs (launch/plan.py).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from dataclasses import asdict

from eps_server.config import ServerArgs
from protocol import cli
from protocol.checkpoints import latest
from protocol.lifecycle import REFUSED, skip_exit_collections
from protocol.trace import merge
from worker.config import DataConfig
from worker.inputs import input_problems

from .config import LaunchArgs, LaunchConfig
from .console import Console, say, table
from .launcher import READY_TIMEOUT, Launcher
from .results import resume_hint
from .roles import exports_checkpoint, run_role, server_config, under_torchrun, worker_args
from .rundir import (
    private_run_dir,
    publish_endpoint,
    remove_run_dir,
    running_jobs,
    withdraw_endpoint,
)


def build(args: LaunchArgs) -> Launcher:
    """Write each child's typed config into a private run directory; the command lines name
    it, plus the endpoint and rank (so ``ps`` tells the processes apart)."""
    run_dir = private_run_dir()
    try:
        return _build(args, run_dir)
    except BaseException:  # (a disk that refuses the run's files)
        remove_run_dir(run_dir)
        raise


def _build(args: LaunchArgs, run_dir: str) -> Launcher:
    a = args.launch
    run_id = a.run_id or secrets.token_hex(4)
    endpoint = a.endpoint or f"ipc://{run_dir}/eps.sock"
    py = sys.executable
    server = server_config(args, endpoint, run_id,
                           trace=os.path.join(run_dir, "trace-eps.json") if a.trace else "")
    cli.write_file(ServerArgs(server=server), os.path.join(run_dir, "eps.json"))
    server_argv = [py, "-m", "eps_server", "--config", os.path.join(run_dir, "eps.json"),
                   "--endpoint", endpoint, "--run-id", run_id]
    workers = []
    for rank in range(a.workers):
        path = os.path.join(run_dir, f"w{rank}.json")
        cli.write_file(worker_args(
            args, endpoint, rank, os.path.join(run_dir, f"worker-{rank}.json"),
            trace=os.path.join(run_dir, f"trace-w{rank}.json") if a.trace else ""), path)
        workers.append([py, "-m", "worker", "--config", path, "--endpoint", endpoint,
                        "--rank", str(rank)])
    logs = os.path.join(a.runs_dir, run_id)
    console = Console(args.worker.steps, logs, verbose=a.verbose, quiet=a.quiet,
                      every=a.log_every)
    cli.write_file(args, os.path.join(logs, "config.json"))  # the job as resolved
    publish_endpoint(logs, endpoint)  # the socket is private: l2l-ctl finds it there
    if not a.quiet:
        where = "" if a.runs_dir == LaunchConfig.runs_dir else f" --runs-dir {a.runs_dir}"
        console.note(f"l2l-launch: run {run_id}, logs in {logs}; watch it with: l2l-ctl "
                     f"status --run {run_id}{where}")
    return Launcher(server_argv, workers, run_id, run_dir, args.worker.steps, console,
                    max_restarts=a.max_restarts,
                    checkpoints=os.path.abspath(server.save) if server.save else "",
                    early_workers=args.worker.eps_timeout >= READY_TIMEOUT,
                    checkpoint_errors=a.checkpoint_errors, boxes=server.boxes.nodes)


BUILT_IN_SHAPE = ("layers", "hidden", "heads", "ffn", "vocab", "tie_embeddings")


def model_summary(model, eps: dict | None) -> dict:
    """The model options, and its parameter count (the EPS's); an hf: model's shape comes from
    its own config, so the built-in models' shape options are left out, not reported."""
    out = asdict(model)
    if model.model.startswith("hf:"):
        for key in BUILT_IN_SHAPE:
            out.pop(key)
    elif model.model == "gpt":  # a language model: no classifier, whatever the default says
        out.pop("classes")
    if eps and "params" in eps:
        out["params"] = eps["params"]
    return out


def summarize(args: LaunchArgs, launcher: Launcher, code: int, elapsed: float) -> dict:
    n = args.launch.workers
    ranks = []
    for r in range(n):
        try:
            with open(os.path.join(launcher.run_dir, f"worker-{r}.json")) as f:
                ranks.append(json.load(f))
        except (OSError, ValueError):
            pass
    # Per step, from the workers' events (a restarted worker's own summary covers only its
    # part of the run).
    progress = sorted(launcher.reports.rows, key=lambda p: p["step"])
    losses = [p["loss"] for p in progress]
    accuracy = [p["accuracy"] for p in progress]
    samples = sum(w["samples"] for w in ranks)
    seconds = max((w["seconds"] for w in ranks), default=0.0)
    if not ranks:  # stopped before the workers wrote their summaries: from the steps' events
        samples, seconds = sum(p["samples"] for p in progress), sum(p["seconds"] for p in progress)
    return {
        "ok": code == 0, "exit_code": code, "failure": launcher.failure,
        "run_id": launcher.run_id, "world_size": n,
        "steps": len(losses), "first_step": progress[0]["step"] if progress else None,
        "losses": losses, "accuracy": accuracy,
        "throughput": [p["samples"] / p["seconds"] if p["seconds"] > 0 else 0.0
                       for p in progress],  # samples/s of each step (its slowest worker)
        # of each step's slowest worker: seconds it waited for weights, and for pushes' acks
        "fetch_wait": [p.get("fetch_wait") for p in progress],
        "push_wait": [p.get("push_wait") for p in progress],
        "samples_per_sec": samples / seconds if seconds > 0 else 0.0,
        "elapsed_seconds": elapsed,
        "workers": [{"rank": w["rank"], "device": w["device"],
                     "peak_memory_bytes": w["peak_memory_bytes"],
                     "samples_per_sec": w["samples_per_sec"],
                     "step_seconds": w["step_seconds"],
                     "fetches_without_round_trip": w["fetches_without_round_trip"],
                     "kept_blocks": w.get("kept_blocks", 0),
                     "kept_block_bytes": w.get("kept_block_bytes", 0)}
                    for w in ranks],
        "config": cli.to_dict(args),
        "model": model_summary(args.model, launcher.eps_stats),
        "save": os.path.abspath(args.launch.save) if args.launch.save and code == 0 else None,
        "eval": launcher.reports.evals,
        "restarts": [{k: v for k, v in r.items() if not k.startswith("_")}
                     for r in launcher.restarts],
        "eps": launcher.eps_stats,
        # checkpoints the EPS could not write (each: step, path, error, last good step, final)
        "checkpoint_failures": [asdict(ev) for ev in launcher.checkpoint_failures],
    }


def main(argv: list[str] | None = None) -> int:
    args = cli.parse(LaunchArgs, argv, "l2l-launch", __doc__.split("\n")[0])
    try:
        args = under_torchrun(args)
    except ValueError as e:
        print(f"l2l-launch: {e}", file=sys.stderr)
        return REFUSED
    if args.launch.plan:
        from .plan import plan_text  # builds the model's manifest: loads torch

        try:  # (the model's files; the data may lie where the job will run: a container)
            problems = input_problems(args.model, DataConfig())
            text = "" if any(problems) else plan_text(args)
        except ValueError as e:
            problems = [str(e)]
        if any(problems):
            for problem in filter(None, problems):
                print(f"l2l-launch: {problem}", file=sys.stderr)
            return REFUSED
        print(text, flush=True)
        return 0
    if args.launch.role != "all":  # a container's one process: the EPS or a worker
        try:
            return run_role(args)
        finally:
            skip_exit_collections()
    problems = input_problems(args.model, args.data) or [output_problem(args)]
    if any(problems):  # found now, once: not by each worker after its start-up, or at the end
        for problem in problems:
            print(f"l2l-launch: {problem}", file=sys.stderr)
        return REFUSED
    for note in (earlier_checkpoints(args), trained_already(args)):
        if note:
            print(f"l2l-launch: {note}", file=sys.stderr)
    try:
        return train(args)[0]
    except OSError as e:  # the run's own files (a full disk): one line, not a traceback
        print(f"l2l-launch: failed: {e}", file=sys.stderr)
        return 1


def earlier_checkpoints(args: LaunchArgs) -> str:
    """A warning when --server-save holds checkpoints this job neither resumes nor keeps: an
    earlier run's, which its own replace (--keep-checkpoints), or ""."""
    root, load = args.server.save, args.server.load
    found = latest(root) if root and os.path.isdir(root) else None
    if found is None or load and os.path.realpath(os.path.dirname(os.path.abspath(
            found[0]))) in (os.path.realpath(load), os.path.realpath(os.path.dirname(load))):
        return ""
    return (f"--server-save {root} holds an earlier run's checkpoints (the latest of step "
            f"{found[1]}): this run's replace them, the oldest first (--keep-checkpoints "
            f"{args.server.keep_checkpoints}); --load {root} would go on from them")


def trained_already(args: LaunchArgs) -> str:
    """A warning when --load's checkpoint is at --steps or past it (a total, not steps more),
    or ""."""
    load, steps = args.server.load, args.worker.steps
    found = latest(load) if load else None  # (None: the EPS says why it cannot load it)
    return (f"--load {load} is at step {found[1]}: --steps {steps}, the step to train until "
            f"(not steps more), is reached already and nothing is trained; give --steps above "
            f"{found[1]}" if found and found[1] >= steps else "")


def output_problem(args: LaunchArgs) -> str:
    """Why the job's outputs (--summary-json, --save, the run's folder) cannot be written, or
    ""."""
    if exports_checkpoint(args) and not args.server.save:
        return ("--save in --eps-mode shard with bf16/fp16 needs --server-save: the fp32 "
                "master is spread over the boxes, and box 0 exports the final checkpoint")
    a = args.launch
    if a.run_id and a.run_id in running_jobs(a.runs_dir):  # (before its folder is touched)
        return (f"--run-id {a.run_id}: a job of this run id runs under {a.runs_dir} (l2l-ctl "
                f"status --run {a.run_id}); give another")
    if problem := unfit_runs_dir(a.runs_dir):
        return f"--runs-dir {a.runs_dir}: {problem}"
    hf = args.model.model.startswith("hf:")  # saved as a directory; other models as a file
    for option, path in (("--summary-json", args.launch.summary_json),
                         ("--save", args.launch.save)):
        problem = (unfit_folder(path, args.model.model[3:]) if hf and option == "--save"
                   else unwritable(path))
        if problem:
            return f"{option} {path}: {problem}"
    return ""


def unfit_runs_dir(path: str) -> str:
    """Why the runs' folder cannot hold this run's logs and files, or "" (nothing is made:
    another problem may refuse the job)."""
    there = os.path.abspath(path)
    while not os.path.exists(there):  # the folder it would be made in
        there = os.path.dirname(there)
    if not os.path.isdir(there):
        return "is a file" if there == os.path.abspath(path) else f"cannot make it ({there} is " \
            "a file)"
    return "" if os.access(there, os.W_OK | os.X_OK) else "not writable"


def unfit_folder(path: str, source: str) -> str:
    """Why an hf: model cannot be saved as a directory at ``path``, or "" (the export's own
    checks, made before training)."""
    if not os.path.exists(path):
        return unwritable(path)
    if not os.path.isdir(path):
        return "exists and is not a folder (a Hugging Face model is saved as a directory)"
    if os.path.samefile(path, source):
        return "is the model's source directory; save elsewhere"
    if os.listdir(path) and not any(os.path.isfile(os.path.join(path, n)) for n in (
            "config.json", "adapter_config.json")):
        return "is a non-empty folder that is not a model; not writing into it"
    return "" if os.access(path, os.W_OK) else "not writable"


def train(args: LaunchArgs) -> tuple[int, dict, Launcher]:
    """The whole job on this box (--role all), as l2l-launch runs it (the Python API too,
    l2l/api.py): build, run, summarize, write the summaries, say the result. Returns the exit
    status, the summary and the launcher (its console has the children's last errors)."""
    launcher = build(args)
    t0 = time.perf_counter()
    try:
        code = launcher.run()
        if code == 0 and exports_checkpoint(args) and args.server.boxes.node_rank == 0:
            code = export_final(args, launcher)
        summary = summarize(args, launcher, code, time.perf_counter() - t0)
        if args.launch.trace:
            parts = ["trace-eps.json"] + [f"trace-w{r}.json" for r in range(args.launch.workers)]
            merge([os.path.join(launcher.run_dir, p) for p in parts], args.launch.trace)
    finally:
        launcher.cleanup()
        withdraw_endpoint(launcher.console.log_dir)
    logs, failed = launcher.console.log_dir, code != 0
    for path in (os.path.join(logs, "summary.json"), args.launch.summary_json):
        if path:  # written before anything is printed: a closed stdout cannot lose it
            try:
                with open(path, "w") as f:
                    json.dump(summary, f, indent=1)
            except OSError as e:
                say(f"l2l-launch: could not write the summary to {path}: {e}", sys.stderr)
                code = code or 1
    if problem := launcher.console.log_error or launcher.log_failed:
        say(f"l2l-launch: warning: some of the children's log lines could not be kept in "
            f"{logs}: {problem}", sys.stderr)
    if code == 0 and summary["checkpoint_failures"]:  # --checkpoint-errors warn
        last = summary["checkpoint_failures"][-1]
        found = latest(last["path"])  # (now: later ones may have been written since)
        good = (f"the latest good one is step {found[1]} in {last['path']}" if found else
                "there is no good one")
        done = "training and --save" if args.launch.save else "training"
        say(f"l2l-launch: warning: {done} completed, but "
            f"{len(summary['checkpoint_failures'])} checkpoint(s) failed (last: "
            f"{last['error']}); {good}", sys.stderr)
    skipped = summary["eps"].get("overflow_steps", 0)
    if code == 0 and skipped and skipped >= summary["steps"]:  # AMP would skip them too
        say(f"l2l-launch: warning: every step's gradient overflowed in fp16 and was skipped: "
            f"the weights did not change (loss scale {summary['eps'].get('loss_scale', 1):g}; "
            "try a lower --loss-scale, or --precision bf16)", sys.stderr)
    if code == 0:
        peak = max((w["peak_memory_bytes"] for w in summary["workers"]), default=0)
        final = summary["losses"][-1] if summary["losses"] else float("nan")
        say(f"done: {summary['steps']} steps, final loss {final:.4f}, "
            f"{summary['samples_per_sec']:,.1f} samples/s, peak worker memory "
            f"{peak / 2**20:.0f} MiB\n" + table(summary_rows(summary, logs), "summary"))
    elif failed:
        say(f"l2l-launch: failed: {launcher.failure} (logs: {logs})"
            f"{'' if launcher.eps_refused else resume_hint(launcher.checkpoints)}", sys.stderr)
        if args.launch.quiet:  # the children's errors were not shown: their last ones
            for name, line in launcher.console.errors.items():
                say(f"  [{name}] {line}", sys.stderr)
    return code, summary, launcher


def export_final(args: LaunchArgs, launcher: Launcher) -> int:
    """Box 0 of a shard job in bf16/fp16: --save from the boxes' final checkpoint (fp32)."""
    from worker.export import export_checkpoint

    try:
        step = export_checkpoint(args.server.save, os.path.abspath(args.launch.save),
                                 args.model)
    except (OSError, ValueError, KeyError) as e:
        launcher.failure = f"could not export the final checkpoint to --save: {e}"
        return 1
    say(f"model of step {step} exported from {args.server.save} to {args.launch.save}")
    return 0


def unwritable(path: str) -> str:
    """Why a file cannot be written at ``path`` (its folder is made), or "" if it can."""
    if not path:
        return ""
    if os.path.isdir(path):
        return "is a folder"
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        return f"cannot make its folder: {e.strerror}"
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        return "not writable"
    return ""


def summary_rows(s: dict, logs: str) -> list[tuple[str, str]]:
    eps = s["eps"]
    rows = [("steps", f"{s['steps']} ({s['elapsed_seconds']:.1f} s)"),
            ("throughput", f"{s['samples_per_sec']:,.1f} samples/s")]
    for w in s["workers"]:
        rows.append((f"w{w['rank']} ({w['device']})", f"{w['samples_per_sec']:,.1f} samples/s, "
                     f"peak memory {w['peak_memory_bytes'] / 2**20:,.0f} MiB"))
    if eps.get("updates"):
        rows.append(("EPS update per layer", f"{1e3 * eps['update_seconds'] / eps['updates']:.2f} "
                     f"ms ({eps['updates']} updates)"))
    if eps.get("pushes"):
        rows.append(("EPS check per push", f"{1e3 * eps['reduce_seconds'] / eps['pushes']:.2f} "
                     f"ms ({eps['pushes']} pushes)"))
    if eps.get("bytes_per_param"):
        growth = eps.get("rss_growth_per_param")
        rows.append(("EPS memory", f"{eps['bytes_per_param']:.1f} B/param held"
                     + (f", peak RSS +{growth:.1f} B/param" if growth else "")))
    if eps.get("clipped_steps") or eps.get("rollbacks"):
        rows.append(("clipped steps", f"{eps['clipped_steps']} ({eps['rollbacks']} layer "
                     "updates rolled back)"))
    if eps.get("overflow_steps"):
        rows.append(("fp16 overflows", f"{eps['overflow_steps']} steps skipped (loss scale now "
                     f"{eps.get('loss_scale', 1):g})"))
    if s["restarts"]:
        rows.append(("restarts", str(len(s["restarts"]))))
    rows.append(("logs", logs))
    return rows


if __name__ == "__main__":
    sys.exit(main())
