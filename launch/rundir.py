"""The launcher's private run directory: the children's config files, the EPS's ipc socket and
the workers' summaries, removed when the launcher ends. A launcher that was killed
(SIGKILL) cannot remove its own: the next launcher removes every one whose launcher is gone.
Each holds a lock file its launcher keeps locked (flock) for its life, which the kernel lets
go when the process dies: a pid would not do across PID namespaces sharing /tmp.

The job's endpoint is kept in its (public) ``runs/<run id>/endpoint`` while it runs, locked the
same way, so that ``l2l-ctl status`` finds a running job without being told its endpoint."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import tempfile

PREFIX = "l2l-run-"
LOCK = "launcher.lock"
ENDPOINT = "endpoint"
_held: dict[str, int] = {}  # this process's run directories -> their locks (open till removed)
_published: dict[str, int] = {}  # endpoint file -> its lock, held while the job runs


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
    _held[path] = fd
    return path


def remove_run_dir(path: str) -> None:
    """Remove a run directory of this process, and let its lock go (a process that runs many
    jobs, e.g. a sweep through l2l.run, must not keep a descriptor per job)."""
    shutil.rmtree(path, ignore_errors=True)
    fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


def publish_endpoint(log_dir: str, endpoint: str) -> None:
    """Write ``endpoint`` to ``log_dir``/endpoint, locked until ``withdraw_endpoint`` (or this
    process's end: a file whose lock is free was left by a launcher that was killed)."""
    path = os.path.join(log_dir, ENDPOINT)
    os.makedirs(log_dir, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.new"  # locked before it is seen (as the run directory's lock)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    with contextlib.suppress(OSError):  # a file system without locks: listed as running
        fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"{endpoint}\n".encode())
    os.rename(tmp, path)
    _published[path] = fd


def withdraw_endpoint(log_dir: str) -> None:
    fd = _published.pop(os.path.join(log_dir, ENDPOINT), None)
    if fd is not None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(log_dir, ENDPOINT))
        os.close(fd)


def running_jobs(runs_dir: str) -> dict[str, str]:
    """Run id -> endpoint of each job running under ``runs_dir`` (its endpoint file locked)."""
    jobs = {}
    for path in sorted(glob.glob(os.path.join(glob.escape(runs_dir), "*", ENDPOINT))):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # taken: its launcher is gone
        except OSError:  # held by its launcher (or no locks there: cannot tell)
            jobs[os.path.basename(os.path.dirname(path))] = os.read(fd, 4096).decode().strip()
        finally:
            os.close(fd)
    return jobs


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
