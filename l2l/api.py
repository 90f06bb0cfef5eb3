"""The Python API: a job from a script or a notebook, on the launcher l2l-launch runs.

A job's options are the command line's: keyword arguments named as the flags, dashes made
underscores (``--micro-batch-size`` -> ``micro_batch_size``, ``--server-save`` ->
``server_save``), over a job file or a config (``config=``), as ``--config FILE`` and flags
are. The job runs as ``l2l-launch`` runs it (launch/__main__.py ``train``): the same processes,
progress, run directory and summary.
"""

from __future__ import annotations

import difflib
import os
import signal
import threading
from functools import cache
from typing import Any

from launch.config import LaunchArgs
from protocol import cli
from worker.config import ModelConfig

__all__ = ["Job", "JobFailed", "run", "export", "config"]


class JobFailed(RuntimeError):
    """A job that did not complete: ``failure`` says why (as l2l-launch's "failed: ..."),
    ``summary`` is its run summary (the steps it trained), ``errors`` each child's last error
    line ({"w1": "..."}), ``logs`` the run's directory."""

    def __init__(self, summary: dict, errors: dict[str, str], logs: str):
        self.summary, self.errors, self.logs = summary, dict(errors), logs
        self.failure = summary.get("failure") or f"exit status {summary.get('exit_code')}"
        lines = [f"the job failed: {self.failure} (logs: {logs})"]
        lines += [f"  [{name}] {line}" for name, line in self.errors.items()]
        super().__init__("\n".join(lines))


@cache
def _options(root: type) -> dict[str, cli.Option]:
    """{keyword: option} of a config tree: each flag without its dashes, "-" made "_"."""
    return {o.flag.lstrip("-").replace("-", "_"): o for o in cli.options(root)}


def _tree(root: type, config: Any, options: dict[str, Any], caller: str) -> Any:
    """``root`` from ``config`` (None, a ``root``, a nested map, or a JSON/YAML job file)
    with ``options`` (keywords named as the flags) over it, as the command line builds it."""
    known = _options(root)
    unknown = [k for k in options if k not in known]
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(f"l2l.{caller}() got an unexpected keyword argument {unknown[0]!r}{hint}")
    if config is None:
        data: dict = {}
    elif isinstance(config, root):
        data = cli.to_dict(config)
    elif isinstance(config, dict):
        data = cli.to_dict(cli.from_dict(root, config))  # checked; a copy
    elif isinstance(config, (str, os.PathLike)):
        data = cli.load_file(os.fspath(config))
    else:
        raise TypeError(f"l2l.{caller}(): config must be a {root.__name__}, a map or a job file's "
                        f"path, not {type(config).__name__}")
    for name, value in options.items():
        node = data
        *parents, leaf = known[name].path
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise cli.ConfigError(f"{key}: expected a map")
        node[leaf] = cli.check_value(known[name].type, _plain(value), name)
    return cli.from_dict(root, data)


def _keyword(problem: str) -> str:
    """A command line's words for a problem, "--summary-json PATH: ...", as the API's."""
    flag, _, rest = problem.partition(" ")
    return f"{flag[2:].replace('-', '_')} {rest}" if flag.startswith("--") else problem


def _plain(value: Any) -> Any:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def config(config: LaunchArgs | dict | str | os.PathLike | None = None,
           **options: Any) -> LaunchArgs:
    """The job's typed config (launch/config.py), as ``l2l-launch --config FILE --flags``
    resolves it: ``config`` (a LaunchArgs, a nested map, or a job file), then ``options``.
    An unknown keyword raises TypeError; a bad value ValueError (cli.ConfigError)."""
    return _tree(LaunchArgs, config, options, "config")


class Job:
    """A job, configured once (checked at once: ``Job(layer=4)`` fails here, not later), run
    with ``run()``; ``summary`` keeps the last run's summary (also a failed one's)."""

    def __init__(self, config: LaunchArgs | dict | str | os.PathLike | None = None,
                 **options: Any):
        self.config: LaunchArgs = _tree(LaunchArgs, config, options, "Job")
        self.summary: dict | None = None

    def __repr__(self) -> str:
        a = self.config
        return (f"Job(model={a.model.model!r}, workers={a.launch.workers}, "
                f"steps={a.worker.steps})")

    def run(self) -> dict:
        """Run the job to its end; returns its summary (what ``--summary-json`` writes).
        Raises JobFailed if it failed. On Ctrl-C (SIGINT) every child is stopped and the
        run's shared memory removed, then KeyboardInterrupt is raised; on SIGTERM the same,
        then the signal is raised again for this process's own handler. Call it from the main
        thread (a script, a notebook): the launcher handles those signals there."""
        from launch.__main__ import output_problem, train
        from launch.roles import under_torchrun
        from worker.inputs import input_problems

        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("l2l.run() must be called from the main thread: the launcher "
                               "stops the job's processes on Ctrl-C and SIGTERM, and Python "
                               "handles signals only there (from another thread, start "
                               "l2l-launch as a subprocess)")
        args = under_torchrun(self.config)
        if args.launch.role != "all" or args.launch.plan:
            raise ValueError("l2l.run() runs the whole job on this box: for role and plan, "
                             "use the l2l-launch command")
        # found now, as l2l-launch finds them: "--save PATH: why" (said as the keyword)
        problems = [p for p in input_problems(args.model, args.data) or [output_problem(args)]
                    if p]
        if problems:
            raise ValueError("; ".join(_keyword(p) for p in problems))
        code, self.summary, launcher = train(args)
        if code == 0:
            return self.summary
        failure = launcher.failure or ""
        if code == 130:  # Launcher.run: interrupted (its children are stopped by now)
            # (its words for a signal: "stopped by signal SIGTERM")
            name = failure.rsplit(" ", 1)[-1] if failure.startswith("stopped by signal") else ""
            if name.startswith("SIG") and name != "SIGINT" and hasattr(signal, name):
                signal.raise_signal(getattr(signal, name))  # what it would have done
            else:
                raise KeyboardInterrupt
        raise JobFailed(self.summary, launcher.console.errors, launcher.console.log_dir)


def run(config: LaunchArgs | dict | str | os.PathLike | None = None, **options: Any) -> dict:
    """Run a job to its end and return its summary: ``Job(config, **options).run()``."""
    return Job(_tree(LaunchArgs, config, options, "run")).run()


def export(checkpoint: str | os.PathLike, out: str | os.PathLike,
           config: ModelConfig | LaunchArgs | str | os.PathLike | None = None,
           **model_options: Any) -> int:
    """What ``l2l-export --checkpoint CHECKPOINT --out OUT`` does: an EPS checkpoint
    (--server-save) written in the model's own format (a Hugging Face directory for an hf:
    model, else safetensors). The model options (``model="bert", layers=4, ...``, or
    ``config``: a job's LaunchArgs, its ModelConfig or its job file, then the options) must
    describe the checkpoint's model; as for l2l-export, those the checkpoint records (a
    launched job's) are the defaults. Returns the checkpoint's step."""
    from worker.export import export_checkpoint, recorded  # loads torch

    saved = recorded({"export": {"checkpoint": os.fspath(checkpoint)}}).get("model", {})
    if isinstance(config, LaunchArgs):
        config = config.model
    elif isinstance(config, (str, os.PathLike)):
        config = {**saved, **cli.load_file(os.fspath(config)).get("model", {})}
    elif config is None:
        config = saved
    model = _tree(ModelConfig, config, model_options, "export")
    return export_checkpoint(os.fspath(checkpoint), os.fspath(out), model)
