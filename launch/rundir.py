"""The launcher's private run directory: the children's config files, the EPS's ipc socket and
the workers' summaries, removed when the launcher ends. A launcher that was killed
(SIGKILL) cannot remove its own: the next launcher removes every one whose launcher is gone.
Each holds a lock file its launcher keeps locked (flock) for its life, which the kernel lets
go when the process dies: a pid would not do across PID namespaces sharing /tmp."""

from __future__ import annotations

import fcntl
import glob
import os
import shutil
import tempfile

PREFIX = "l2l-run-"
LOCK = "launcher.lock"
_held: list[int] = []  # this process's run directories' locks (open for its life)


def base_dir() -> str:
    return os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()


def private_run_dir() -> str:
    """A new run directory (mode 0700), after removing those of launchers that are gone."""
    remove_abandoned()
    path = tempfile.mkdtemp(prefix=PREFIX, dir=base_dir())
    # Locked under another name, then renamed: a directory whose lock file exists is never
    # seen unlocked while its launcher lives.
    fd = os.open(os.path.join(path, LOCK + ".new"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, str(os.getpid()).encode())
    os.rename(os.path.join(path, LOCK + ".new"), os.path.join(path, LOCK))
    _held.append(fd)
    return path


def remove_abandoned() -> list[str]:
    """Remove this user's run directories whose launcher is gone (their lock is free);
    returns them. One without a lock file (being made, or of an older version) is left."""
    gone = []
    for path in glob.glob(os.path.join(base_dir(), PREFIX + "*")):
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            fd = os.open(os.path.join(path, LOCK), os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its launcher lives
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        gone.append(path)
    return gone
