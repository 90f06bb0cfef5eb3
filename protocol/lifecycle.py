"""Process lifecycle: the contract between l2l-launch and its children, and how an EPS tells
that a worker's process has exited.

A launcher sets ``L2L_PARENT_PID`` in a child's environment; the child calls
``die_with_parent()`` at start-up, so it is sent a signal if the launcher dies, even by SIGKILL:
SIGTERM for an EPS (it must unlink its shared memory), SIGKILL for a worker (it holds nothing
to clean up, and a stopped process, e.g. by SIGSTOP or a debugger, never acts on SIGTERM).
Linux only (prctl, /proc); elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import gc
import os
import re
import signal
import sys

ENV = "L2L_PARENT_PID"
# A process that refuses its settings (argparse's usage errors, a bad option, a busy endpoint,
# a checkpoint it cannot load) exits with this status: starting it again would not help.
REFUSED = 2
_PR_SET_PDEATHSIG = 1


def exit_status(code: int) -> str:
    """How a child ended, in words: "exited with status 1", or "was killed by SIGKILL"
    (subprocess gives a signal as a negative code, which says little to a reader)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    parent = os.environ.get(ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except OSError:
        return
    if os.getppid() != int(parent):  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)


# -- process identity ------------------------------------------------------------------------
# A worker names its process in its Hello so that an EPS on the same machine and in the same
# PID namespace can tell at once that the process holding a rank has exited (and free the
# rank for a replacement) instead of waiting out the heartbeat timeout. Elsewhere (another
# host or container), or where /proc does not answer plainly, nothing is told from it and the
# timeout decides as before: a process is judged exited only when the kernel says no such
# process exists (or its pid now belongs to one started later).

IDENTITY = re.compile(r"[0-9a-f-]{1,64}:[0-9]{1,20}:[0-9]{1,10}:[0-9]{1,20}")


def skip_exit_collections() -> None:
    """Call as a process's main returns: the interpreter's last garbage collections then pass
    over every object alive now (``gc.freeze``). With torch loaded they take most of a second
    of CPU for nothing: the memory goes back with the process, and whatever must be closed
    (sockets, shared memory, logs, event and trace files) is closed explicitly before."""
    gc.freeze()


def _machine() -> str:
    """This boot of this machine and this PID namespace ("" if /proc is not this namespace's,
    where pids read there mean something else, or in a time namespace with offsets, where
    start times read in /proc are shifted by the reader's offset)."""
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            return ""
        try:
            with open("/proc/self/timens_offsets") as f:
                if any(int(v) for line in f for v in line.split()[1:]):
                    return ""
        except FileNotFoundError:  # a kernel without time namespaces
            pass
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}" if boot else ""
    except OSError:
        return ""


def _start_time(pid: int | str) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks since boot); "" if there is no
    such process (or it has exited and awaits its parent); None if /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:  # gone, or hidden (hidepid): ask the kernel
        if pid == "self":
            return None
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return ""
        except OSError:  # EPERM: it exists, another user's
            pass
        return None
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()  # after the command name, which may hold anything
    if len(fields) < 20:
        return None
    return "" if fields[0] in (b"Z", b"X") else fields[19].decode("ascii", "replace")


def process_identity() -> str:
    """``boot id:pid namespace:pid:start time`` of this process ("" where /proc cannot say)."""
    machine, start = _machine(), _start_time("self")
    identity = f"{machine}:{os.getpid()}:{start}" if machine and start else ""
    return identity if IDENTITY.fullmatch(identity) else ""


def process_alive(identity: str) -> bool | None:
    """Whether the process ``identity`` (a ``process_identity``) names is alive: None when that
    cannot be told (another machine or PID namespace, /proc unreadable, malformed); False once
    it has exited or its pid belongs to another process now. Never raises."""
    try:
        if not IDENTITY.fullmatch(identity):
            return None
        machine, pid, start = identity.rsplit(":", 2)
        if machine != _machine():
            return None
        now = _start_time(int(pid))
        return None if now is None else now == start
    except Exception:  # a judgement of liveness must never take its caller down
        return None


def process_gone(identity: str) -> bool:
    """True only if ``identity`` names a process of this machine and PID namespace that has
    exited; False when it is alive or nothing can be told."""
    return process_alive(identity) is False
