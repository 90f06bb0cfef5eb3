"""The launcher's child processes: each in its own session (Ctrl-C reaches only the launcher),
signalled as a group, stopped in the order a job's shutdown needs."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    threads: list[threading.Thread] = field(default_factory=list)
    hung: float | None = None  # the EPS declared it dead after this many silent seconds


def stop(children: list[Child], grace: float, bye_grace: float) -> None:
    """Stop every child still running: SIGTERM to the workers, then to the EPS (a worker's Bye
    needs it) once they exited or ``bye_grace`` passed, SIGKILL at ``grace``; then wait for
    each child's reader threads."""
    alive = [c for c in children if c.proc.poll() is None]
    deadline = time.monotonic() + grace
    for last in (False, True):
        group = [c for c in alive if (c.name == "eps") == last]
        for c in group:
            signal_group(c.proc, signal.SIGTERM)
            signal_group(c.proc, signal.SIGCONT)  # a stopped (hung) process handles it too
        end = deadline if last else min(deadline, time.monotonic() + bye_grace)
        for c in alive if last else group:
            try:
                c.proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                if last:
                    signal_group(c.proc, signal.SIGKILL)
                    c.proc.wait()
    for c in children:
        for t in c.threads:
            t.join(timeout=2.0)


def reaped(proc: subprocess.Popen, grace: float) -> bool:
    """Wait for a process the EPS saw exit (a SIGKILLed process's main thread is a zombie
    while its other threads still exit); False if it is still running after ``grace``."""
    try:
        proc.wait(timeout=grace)
        return True
    except subprocess.TimeoutExpired:
        return False


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the child's whole session (it may have children)
    except (ProcessLookupError, PermissionError):
        pass
