"""l2l-launch: one eps-server and N l2l-workers on this box, as separate processes.

Like torchrun, a convenience over the two real CLIs: it picks a private ipc endpoint and a run
id, starts the server and the workers (with --device cuda, worker r on cuda:(r mod GPUs);
they wait for the server to answer), shows the job's progress (launch/console.py), and writes a
run summary. On Ctrl-C, SIGTERM or any child's failure it stops every child (SIGTERM, then
SIGKILL), and removes the run's shared memory and socket, so nothing is left behind.

Each child gets a pipe for its typed events (``--events fd:N``, protocol/events.py): the EPS's
"ready", lost workers and final statistics, each worker's joins and steps. The children's stdout
and stderr are logs: written to the run directory, their warnings and errors shown with a
``[name]`` prefix (everything with --verbose, nothing with --quiet), never parsed.

With ``max_restarts`` N (torchelastic's semantics: N restarts in all), a worker that exits with
an error, or that the EPS declares dead (a hung one is killed first), is started again with the
same rank: it rejoins and redoes the step it was in exactly (the EPS runs with --recovery). An
EPS that dies takes the job down: every worker is stopped and the job starts again from the
EPS's last checkpoint (--server-save), losing the steps after it, also if it dies as it starts
(one that refuses its settings fails the job at once). Without restarts, any failure is final.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

from protocol import events
from protocol.checkpoints import latest, stamp
from protocol.lifecycle import ENV as PARENT_ENV
from protocol.lifecycle import REFUSED, exit_status
from protocol.shm import unlink_run

from .children import Child, reaped, signal_group, stop
from .console import Console
from .reports import Reports
from .results import checkpoint_failure, eval_line
from .rundir import remove_run_dir

READY_TIMEOUT = 120.0
STOP_GRACE = 10.0
BYE_GRACE = 3.0  # on a stop, the workers' head start over the EPS
NO_FAULT = ["--fault", ""]  # a replacement never inherits a test's fault


class Launcher:
    def __init__(self, server_argv: list[str], worker_argvs: list[list[str]], run_id: str,
                 run_dir: str, steps: int, console: Console, max_restarts: int = 0,
                 checkpoints: str = "", early_workers: bool = True,
                 checkpoint_errors: str = "warn", boxes: int = 1):
        self.server_argv, self.worker_argvs = server_argv, worker_argvs
        self.early_workers = early_workers  # see _start_job
        self.run_id, self.run_dir, self.steps = run_id, run_dir, steps
        self.console, self.max_restarts = console, max_restarts
        self.checkpoints = checkpoints  # the EPS's checkpoint root (--server-save), or ""
        self.checkpoint_errors, self.boxes = checkpoint_errors, boxes  # LaunchConfig, --nodes
        self.checkpoint_failures: list[events.CheckpointFailed] = []
        self._foreign = stamp(checkpoints)  # there before (another run's, or loaded): not ours
        self.restarts: list[dict] = []  # what failed, when it was noticed, how it came back
        self.children: list[Child] = []
        self.workers: dict[int, Child] = {}
        self.server: Child | None = None
        self._lost: list[events.PeerLost] = []
        self.reports = Reports(len(worker_argvs), boxes)  # the steps' rows, the evaluations
        self._ready = threading.Event()
        self._ready_step = 0  # the step the EPS serves from (Ready: a resumed checkpoint's)
        self._lock = threading.Lock()
        self.failure: str | None = None
        self.log_failed: Exception | None = None  # a child log line the console could not take
        self.eps_stats: dict = {}

    # ------------------------------------------------------------------------- children

    def _spawn(self, name: str, argv: list[str]) -> Child:
        env = dict(os.environ, **{PARENT_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1"})
        read_fd, write_fd = os.pipe()
        try:
            proc = subprocess.Popen([*argv, "--events", f"fd:{write_fd}"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, env=env, text=True, bufsize=1,
                                    errors="replace",  # an odd byte must not kill the reader
                                    pass_fds=(write_fd,),
                                    start_new_session=True)  # Ctrl-C reaches only the launcher
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)  # the child holds it now: EOF when the child is gone
        child = Child(name, proc)
        self.children.append(child)  # registered first: stop_all must see it whatever happens
        readers = [(self._log, proc.stdout), (self._log, proc.stderr),
                   (self._events, os.fdopen(read_fd, "r", errors="replace"))]
        for target, stream in readers:
            t = threading.Thread(target=target, args=(name, stream), daemon=True)
            t.start()
            child.threads.append(t)
        return child

    def _log(self, name: str, stream) -> None:
        with stream:
            for line in stream:  # keep draining whatever happens, or the child blocks
                try:
                    self.console.log(name, line)
                except Exception as e:  # e.g. the disk is full: the job goes on
                    self.log_failed = self.log_failed or e

    def _events(self, name: str, stream) -> None:
        with stream:
            for line in stream:
                try:
                    ev = events.decode(line)
                except ValueError as e:
                    self.console.note(f"l2l-launch: bad event from {name}: {e}")
                    continue
                if isinstance(ev, events.Ready):
                    self._ready_step = ev.step
                    self._ready.set()
                elif isinstance(ev, events.Starting):  # alive: patience counts from now
                    self._ready_by = time.monotonic() + READY_TIMEOUT + ev.patience
                elif isinstance(ev, events.PeerLost):
                    with self._lock:
                        self._lost.append(ev)
                elif isinstance(ev, events.Joined):
                    self._on_joined(ev)
                elif isinstance(ev, events.CheckpointFailed):
                    self._on_checkpoint_failed(ev)
                elif isinstance(ev, events.ServerStats):
                    self.eps_stats = ev.stats
                elif isinstance(ev, events.StepDone):
                    self._on_step(ev)
                elif isinstance(ev, events.EvalDone):
                    self._on_eval(ev)

    def _on_checkpoint_failed(self, ev: events.CheckpointFailed) -> None:
        """Said at once (also --quiet) the first time and for the final one; counted."""
        with self._lock:
            self.checkpoint_failures.append(ev)
            first = len(self.checkpoint_failures) == 1
        if first or ev.final:
            self.console.note(checkpoint_failure(ev, self.checkpoint_errors))

    def _on_step(self, ev: events.StepDone) -> None:
        for row in self.reports.step(ev):
            self.console.step(row)

    def _on_eval(self, ev: events.EvalDone) -> None:
        if (result := self.reports.evaluation(ev)) is not None:
            self.console.note(eval_line(result), err=False)

    # ------------------------------------------------------------------------- run

    def run(self) -> int:
        """Run the job; returns the exit status (0 when every worker finished)."""
        old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in old:
            signal.signal(s, self._on_signal)
        try:
            return self._run()
        except KeyboardInterrupt:
            self.failure = self.failure or "interrupted"
            return 130
        finally:
            for s in old:  # a second Ctrl-C must not cut the clean-up short
                signal.signal(s, signal.SIG_IGN)
            try:
                self.stop_all()
            finally:
                for s, h in old.items():
                    signal.signal(s, h)
                self.console.close()

    def _on_signal(self, signum, frame) -> None:
        self.failure = f"stopped by signal {signal.Signals(signum).name}"
        raise KeyboardInterrupt

    def _on_joined(self, ev: events.Joined) -> None:
        for row in self.reports.joined(ev):  # steps its predecessor trained, unreported
            self.console.step(row)
        with self._lock:
            pending = [r for r in self.restarts if r.get("rank") == ev.rank
                       and "rejoined_after" not in r]
            if not ev.rejoined or not pending:
                return
            entry = pending[-1]
            entry.update(rejoined_after=round(time.monotonic() - entry.pop("_t"), 3),
                         resumed_step=ev.step, layers_already_pushed=ev.pushed)
        left = f"it redoes step {ev.step + 1} ({ev.pushed} of its layers were pushed " \
            "already)" if ev.step < self.steps else "its steps were all done already"
        self.console.note(f"l2l-launch: w{ev.rank} rejoined {entry['rejoined_after']:.1f} s "
                          f"later; {left}")

    def _start_job(self, extra: list[str] = (), replacement: bool = False) -> bool:
        """Start the EPS and every worker; wait until the EPS is ready. ``early_workers``: the
        workers start at once, their start-up (imports, model, data) overlapping the EPS's
        (they wait for it: --eps-timeout >= READY_TIMEOUT), and one that fails meanwhile is
        seen at once; otherwise they start once it is ready."""
        self._ready.clear()
        self._ready_by = time.monotonic() + READY_TIMEOUT  # (a Starting event moves it on)
        self.server = self._spawn("eps", [*self.server_argv, *extra])
        everyone = range(len(self.worker_argvs))
        if self.early_workers:
            self._start_workers(everyone, replacement)
        while not self._ready.wait(0.1):
            if self.server.proc.poll() is not None:
                self.failure = (f"eps-server "
                                f"{exit_status(self.server.proc.returncode)} before it was ready")
                return False
            if self.early_workers and not self._check_workers():
                return False
            if time.monotonic() > self._ready_by:
                self.failure = f"eps-server not ready, and silent for {READY_TIMEOUT:.0f} s"
                return False
        if not self.early_workers:
            self._start_workers(everyone, replacement)
        return True

    def _start_workers(self, ranks, replacement: bool) -> None:
        for r in ranks:
            self.workers[r] = self._spawn(f"w{r}", self.worker_argvs[r] +
                                          (NO_FAULT if replacement else []))

    def _may_restart(self, what: str) -> bool:
        if len(self.restarts) < self.max_restarts:
            return True
        self.failure = what if not self.max_restarts else \
            f"{what}; no restarts left (--max-restarts {self.max_restarts})"
        return False


    def _run(self) -> int:
        if not self._start_job() and not (self._died_starting() and
                                          self._recover(self.failure)):
            return 1
        self.console.start()
        server_gone: float | None = None
        while True:
            code = self.server.proc.poll()  # first: its workers fail when it is gone
            if code not in (None, 0):
                if not self._recover(f"eps-server {exit_status(code)} while workers ran"):
                    return 1
                server_gone = None
                continue
            if not self._check_workers():
                return 1
            if self.checkpoint_failures and self.checkpoint_errors == "fail":
                ev = self.checkpoint_failures[0]
                self.failure = (f"checkpoint of step {ev.step} to {ev.path} failed: {ev.error} "
                                "(--checkpoint-errors fail)")
                return 1
            if all(w.proc.poll() == 0 for w in self.workers.values()):
                break
            if code == 0:
                # A clean server exit is expected once every worker said Bye (the workers are
                # then only closing); workers that never exit are a failure.
                server_gone = server_gone or time.monotonic()
                if time.monotonic() - server_gone > STOP_GRACE:
                    self.failure = "workers did not exit after the eps-server finished"
                    return 1
            time.sleep(0.05)
        try:  # workers said Bye(done); the server saves (if asked) and exits by itself
            self.server.proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            self.failure = "eps-server did not exit after the workers finished"
            return 1
        if self.server.proc.returncode != 0:
            self.failure = f"eps-server {exit_status(self.server.proc.returncode)}"
            return 1
        for t in self.server.threads:  # its events read to the end (a final checkpoint's)
            t.join(timeout=5.0)
        if self.checkpoint_failures and self.checkpoint_errors == "fail":
            ev = self.checkpoint_failures[-1]
            self.failure = f"{'final ' if ev.final else ''}checkpoint failed: {ev.error}"
            return 1
        return 0

    def _recover(self, what: str) -> bool:
        """The EPS died: restart the job, again while the new EPS is killed as it starts,
        within --max-restarts. False when the job has failed."""
        while True:
            if not self._may_restart(what):
                return False
            if self._restart_job(what):
                self.failure = None  # a failed start on the way was recovered from
                return True
            if not self._died_starting():  # a worker, a timeout, the EPS's own error
                return False
            what = self.failure

    @property
    def eps_refused(self) -> bool:
        """The EPS refused its settings (exit status REFUSED): a checkpoint it cannot load, a
        bad option; no checkpoint is worth a --load hint then."""
        return self.server is not None and self.server.proc.poll() == REFUSED

    def _died_starting(self) -> bool:
        """The EPS died before it was ready, killed (the OOM killer, an operator) or crashed:
        a restart may cure that. One that refused its settings (a bad option, a busy endpoint,
        a checkpoint it cannot load: exit status REFUSED) said why: it would refuse again."""
        code = self.server.proc.returncode if self.server else None
        return (code not in (None, 0, REFUSED) and self.failure is not None
                and self.failure.endswith("before it was ready"))

    def _check_workers(self) -> bool:
        """Stop hung workers, restart failed ones; False when the job has failed."""
        with self._lock:
            lost, self._lost = self._lost, []
        for ev in lost:  # a hung worker: stop it; its exit is handled below
            w = self.workers.get(ev.rank)
            if w is None or w.proc.pid != ev.pid or w.proc.poll() is not None:
                continue
            if ev.exited and reaped(w.proc, STOP_GRACE):  # dead: its threads were exiting
                continue
            what = (f"w{ev.rank} (pid {ev.pid}) was declared dead by the EPS after "
                    f"{ev.silent:.1f} s without a message")
            if not self._may_restart(what):
                return False
            self.console.note(f"l2l-launch: {what}; killing it")
            w.hung = ev.silent
            signal_group(w.proc, signal.SIGKILL)
            w.proc.wait()
        for r, w in list(self.workers.items()):
            code = w.proc.poll()
            eps = self.server.proc if self.server else None
            if code in (None, 0) or eps and reaped(eps, 1.0) and eps.returncode != 0:
                continue  # a dying EPS told it why: its restart (the whole job's) covers it
            what = f"w{r} {exit_status(code)}"
            if code == REFUSED:  # its own refusal (its options, --save): it would again
                self.failure = what
                return False
            if not self._may_restart(what):
                return False
            self.restarts.append({
                "rank": r, "cause": f"hung: declared dead after {w.hung:.1f} s without a "
                "message" if w.hung is not None else exit_status(code),
                "detected_after": round(w.hung or 0.0, 3), "steps_done": self.reports.completed(),
                "_t": time.monotonic()})
            self.console.note(f"l2l-launch: {what}; restarting rank {r} "
                              f"({len(self.restarts)}/{self.max_restarts})")
            self._start_workers([r], replacement=True)
        return True

    def _restart_job(self, what: str) -> bool:
        """The EPS died: stop the workers, start everything again from its last checkpoint
        (or, with several boxes, the newest one every box holds: its Ready says which)."""
        self.stop_all()
        found = latest(self.checkpoints) if self.checkpoints else None
        step = found[1] if found and stamp(self.checkpoints) != self._foreign else None
        done = self.reports.completed()
        start = self.reports.replay_from(step if step is not None
                                         else min(self.reports.steps, default=0))
        self.restarts.append({"rank": None, "cause": what, "detected_after": 0.0,
                              "steps_done": done, "checkpoint_step": step,
                              "steps_replayed": max(0, done - start)})
        self.console.note(
            f"l2l-launch: {what}; restarting the job from "
            f"{f'the checkpoint of step {step}' if step is not None else 'where it began'} "
            f"({len(self.restarts)}/{self.max_restarts}): {max(0, done - start)} "
            "completed steps are lost and trained again")
        extra = ["--load", self.checkpoints] if step is not None else []
        if not self._start_job(extra, replacement=True):
            return False
        if step is not None and self._ready_step < step:  # the boxes agreed on an older one
            start = self.reports.replay_from(self._ready_step)
            self.restarts[-1].update(checkpoint_step=start, steps_replayed=max(0, done - start))
            self.console.note(f"l2l-launch: the boxes resume from step {start}, the newest "
                              "checkpoint every box holds")
        return True

    def stop_all(self) -> None:
        """Stop every child still running (children.stop), then remove what the run left in
        shared memory (named after the run id)."""
        stop(self.children, STOP_GRACE, BYE_GRACE)
        leaked = unlink_run(self.run_id)
        if leaked:
            self.console.note(f"l2l-launch: removed shared memory left by the run: "
                              f"{', '.join(leaked)}")

    def cleanup(self) -> None:
        """Remove the run's private directory (socket, per-worker summaries)."""
        remove_run_dir(self.run_dir)
