"""The launcher's private run directory: the children's config files, the EPS's ipc socket and
the workers' summaries, removed when the launcher ends. A launcher that was killed
(SIGKILL) cannot remove its own: the next launcher removes every one whose launcher is gone
(each holds its launcher's pid)."""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

PREFIX = "l2l-run-"
PID_FILE = "launcher.pid"


def base_dir() -> str:
    return os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()


def private_run_dir() -> str:
    """A new run directory (mode 0700), after removing those of launchers that are gone."""
    remove_abandoned()
    path = tempfile.mkdtemp(prefix=PREFIX, dir=base_dir())
    with open(os.path.join(path, PID_FILE), "w") as f:
        f.write(str(os.getpid()))
    return path


def remove_abandoned() -> list[str]:
    """Remove this user's run directories whose launcher process no longer exists; returns
    them. One without a pid file (being made) or whose launcher lives is left alone."""
    gone = []
    for path in glob.glob(os.path.join(base_dir(), PREFIX + "*")):
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            with open(os.path.join(path, PID_FILE)) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process has the pid now
        return True
    return True
