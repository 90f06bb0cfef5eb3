"""Process lifecycle contract between l2l-launch and its children.

A launcher sets ``L2L_PARENT_PID`` in a child's environment; the child calls
``die_with_parent()`` at start-up, so it is sent SIGTERM (and cleans up) if the launcher dies,
even by SIGKILL. Linux only (prctl); elsewhere it does nothing.
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
