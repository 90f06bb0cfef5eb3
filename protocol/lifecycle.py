"""Process lifecycle: the contract between l2l-launch and its children, and how an EPS tells
that a worker's process has exited.

A launcher sets ``L2L_PARENT_PID`` in a child's environment; the child calls
``die_with_parent()`` at start-up, so it is sent SIGTERM (and cleans up) if the launcher dies,
even by SIGKILL. Linux only (prctl, /proc); elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

ENV = "L2L_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    parent = os.environ.get(ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except OSError:
        return
    if os.getppid() != int(parent):  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


# -- process identity ------------------------------------------------------------------------
# A worker names its process in its Hello so that an EPS on the same machine and in the same
# PID namespace can tell at once that the process holding a rank has exited (and free the
# rank for a replacement) instead of waiting out the heartbeat timeout. Elsewhere (another
# host or container) nothing can be told from it, and the timeout decides as before.


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _start_time(pid: int | str) -> str:
    """Field 22 of /proc/PID/stat (start time in clock ticks since boot), "" if the process is
    gone; "zombie" if it has exited but is not reaped yet."""
    stat = _read(f"/proc/{pid}/stat")
    fields = stat[stat.rfind(")") + 2:].split()  # after the command name, which may hold spaces
    if len(fields) < 20:
        return ""
    return "zombie" if fields[0] in ("Z", "X") else fields[19]


def _machine() -> str:
    """This boot of this machine and this PID namespace: pids mean the same only within both."""
    boot = _read("/proc/sys/kernel/random/boot_id").strip()
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}:{ns}" if boot else ""


def process_identity() -> str:
    """``boot id:pid namespace:pid:start time`` of this process ("" where /proc cannot say)."""
    machine, start = _machine(), _start_time("self")
    return f"{machine}:{os.getpid()}:{start}" if machine and start else ""


def process_alive(identity: str) -> bool | None:
    """Whether the process ``identity`` (a ``process_identity``) names is alive: None when that
    cannot be told (another machine or PID namespace, no /proc, malformed); False once it has
    exited or its pid belongs to another process now."""
    parts = identity.rsplit(":", 2)
    if len(parts) != 3 or not parts[1].isdigit() or not parts[0] or parts[0] != _machine():
        return None
    return _start_time(int(parts[1])) == parts[2]


def process_gone(identity: str) -> bool:
    """True only if ``identity`` names a process of this machine and PID namespace that has
    exited; False when it is alive or nothing can be told."""
    return process_alive(identity) is False
