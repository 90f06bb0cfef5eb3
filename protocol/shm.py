"""Named POSIX shared-memory regions: create (owner only), attach, view as tensors, unlink.

Why not ``multiprocessing.shared_memory``: on Python 3.11 its resource tracker unlinks a
segment when *any* process that attached it exits. Here only the creator (the EPS) unlinks, and
attaching processes never register anything. Regions are created with mode 0600 and an
attacher refuses a region that is not owned by its own user or is readable by others.
"""

from __future__ import annotations

import _posixshmem
import mmap
import os
import re
import stat
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads when a region is first viewed as a tensor: l2l-ctl and the
    import torch  # launcher only list and remove regions

_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_RUN_ID = re.compile(r"[A-Za-z0-9_]{1,64}")
SHM_DIR = "/dev/shm"  # Linux; used only to list regions by prefix for cleanup


def is_run_id(run_id: str) -> bool:
    """A run id names its regions (l2l-<run id>-...) and its runs/ folder: 1..64 letters,
    digits or underscores."""
    return bool(_RUN_ID.fullmatch(run_id))


def check_name(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"bad shared-memory name {name!r}: use [A-Za-z0-9._-], 1..200 chars")
    return name


class Region:
    """One mapped shared-memory region. Use ``create`` (owner) or ``attach``."""

    def __init__(self, name: str, nbytes: int, mm: mmap.mmap, owner: bool, writable: bool):
        self.name = name
        self.nbytes = nbytes
        self.owner = owner
        self.writable = writable
        self._mm = mm
        self._base: torch.Tensor | None = None
        self._unlinked = False

    # -- lifecycle ------------------------------------------------------------------------

    @classmethod
    def create(cls, name: str, nbytes: int) -> Region:
        """Create a new region of ``nbytes`` (zero-filled), readable only by this user."""
        check_name(name)
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.fchmod(fd, 0o600)  # independent of umask
            if nbytes:
                os.ftruncate(fd, nbytes)
                try:  # reserve now: a full /dev/shm is an error here, not a SIGBUS later
                    os.posix_fallocate(fd, 0, nbytes)
                except OSError as e:
                    raise OSError(e.errno, f"cannot reserve {nbytes} bytes of shared memory "
                                  f"for {name!r} ({e.strerror}); /dev/shm is too small (in "
                                  "Docker, raise shm_size)") from None
                mm = mmap.mmap(fd, nbytes)
            else:
                mm = mmap.mmap(-1, 1)  # mmap cannot map 0 bytes; nothing is shared
        except BaseException:
            os.close(fd)
            _posixshmem.shm_unlink("/" + name)
            raise
        os.close(fd)
        return cls(name, nbytes, mm, owner=True, writable=True)

    @classmethod
    def attach(cls, name: str, nbytes: int, writable: bool = True) -> Region:
        """Map an existing region; checks its size, owner and permissions."""
        check_name(name)
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR if writable else os.O_RDONLY, mode=0)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid():
                raise PermissionError(f"region {name!r} is owned by uid {st.st_uid}, not us")
            if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise PermissionError(f"region {name!r} is accessible by other users")
            if st.st_size != nbytes:
                raise ValueError(f"region {name!r} has {st.st_size} bytes, expected {nbytes}")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(fd, nbytes, prot=prot) if nbytes else mmap.mmap(-1, 1)
        finally:
            os.close(fd)
        return cls(name, nbytes, mm, owner=False, writable=writable)

    def unlink(self) -> None:
        """Remove the name (owner only). Mappings stay valid until closed."""
        if self.owner and not self._unlinked:
            self._unlinked = True
            try:
                _posixshmem.shm_unlink("/" + self.name)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unmap, unless tensors still view the region: then the mapping stays until they are
        gone (mmap refuses while the memoryview behind them is exported), never unmapped
        under a live view."""
        self._base = None
        try:
            self._mm.close()
        except BufferError:
            pass

    # -- views ----------------------------------------------------------------------------

    @property
    def base(self) -> torch.Tensor:
        """The whole region as a uint8 tensor (shares memory)."""
        if self._base is None:
            import torch

            with warnings.catch_warnings():
                # frombuffer warns on read-only buffers; read-only mappings are never written.
                warnings.simplefilter("ignore", UserWarning)
                # Through a memoryview: torch.frombuffer(mmap) does not keep the buffer exported,
                # so mmap.close() would unmap under live tensors.
                self._base = torch.frombuffer(memoryview(self._mm), dtype=torch.uint8)
        return self._base

    def tensor(self, dtype: torch.dtype, offset_elems: int = 0, numel: int | None = None
               ) -> torch.Tensor:
        """A 1-D view of ``numel`` elements of ``dtype`` starting at element ``offset_elems``."""
        size = dtype.itemsize
        if numel is None:
            numel = self.nbytes // size - offset_elems
        start, end = offset_elems * size, (offset_elems + numel) * size
        if offset_elems < 0 or numel < 0 or end > self.nbytes:
            raise ValueError(f"view [{start}, {end}) outside region {self.name!r} "
                             f"of {self.nbytes} bytes")
        return self.base[start:end].view(dtype)

    def __repr__(self) -> str:
        return f"Region({self.name!r}, {self.nbytes} bytes, owner={self.owner})"


def list_regions(prefix: str) -> list[str]:
    """Names of existing regions starting with ``prefix`` (Linux /dev/shm)."""
    check_name(prefix)
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def unlink_prefix(prefix: str) -> list[str]:
    """Unlink every region whose name starts with ``prefix``; returns the names removed.
    Used by launchers to clean up after an EPS that could not clean up itself (SIGKILL)."""
    removed = []
    for name in list_regions(prefix):
        try:
            _posixshmem.shm_unlink("/" + name)
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def unlink_run(run_id: str) -> list[str]:
    """Remove run ``run_id``'s regions and lock file, unless a live server holds the lock (a
    second launch of the same run id must not take a running job's memory away); returns
    the names removed. For launchers, once their EPS has exited (SIGKILL leaves them)."""
    lock = _lock_path(run_id)
    fd = _try_lock(lock, create=False)  # (while it is held here, a server of this run id
    if fd is None and os.path.exists(lock):  # starting is refused: "in use"; it is brief)
        return []  # held: a live server's
    try:
        removed = _unlink(list_regions(f"l2l-{run_id}-"), keep=os.path.basename(lock))
        if fd is not None:
            os.unlink(lock)
            removed.append(os.path.basename(lock))
    finally:
        if fd is not None:
            os.close(fd)
    return removed


class RunLock:
    """Held by an EPS for as long as it runs: an exclusive flock on ``l2l-<run>-lock`` in
    /dev/shm (the kernel drops it when the process dies, however it dies). The file outlives
    a killed server, so regions of a run whose lock file exists but is free were left by a dead
    server and may be removed (``orphaned``); a clean exit removes the file last."""

    def __init__(self, run_id: str):
        self.path = _lock_path(run_id)
        try:
            self._fd: int | None = _try_lock(self.path, create=True)
        except PermissionError:  # another user's lock file (shared memory is per user)
            raise ValueError(f"run id {run_id!r} is in use by another user's eps-server (its "
                             f"lock {self.path} is not ours); give another --run-id") from None
        if self._fd is None:
            raise ValueError(f"run id {run_id!r} is in use by a running eps-server")

    def remove_stale(self) -> list[str]:
        """Remove regions of this run id left by an earlier server of the same id that died
        (none can be a live server's: we hold the lock). Call before creating any."""
        lock = os.path.basename(self.path)
        return _unlink(list_regions(lock[: -len("lock")]), keep=lock)

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = None


def _lock_path(run_id: str) -> str:
    return os.path.join(SHM_DIR, check_name(f"l2l-{run_id}-lock"))


def _try_lock(path: str, create: bool) -> int | None:
    """An fd holding an exclusive flock on ``path``, or None if a live process holds it (or,
    with ``create`` False, if there is no such file)."""
    import fcntl

    while True:
        try:
            fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:  # the file may have been removed (a cleanup) between open and flock
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
        if not create:
            return None


def _unlink(names: list[str], keep: str) -> list[str]:
    """Unlink this user's regions among ``names`` but ``keep``; others' are left alone."""
    removed = []
    for name in names:
        try:
            if name != keep and os.stat(os.path.join(SHM_DIR, name)).st_uid == os.getuid():
                _posixshmem.shm_unlink("/" + name)
                removed.append(name)
        except (FileNotFoundError, PermissionError):
            pass
    return removed


def _runs() -> dict[str, list[str]]:
    """{run id: names of its regions} for this user's ``l2l-<run>-...`` regions."""
    runs: dict[str, list[str]] = {}
    for name in list_regions("l2l-"):
        parts = name.split("-")
        try:
            if len(parts) >= 3 and os.stat(os.path.join(SHM_DIR, name)).st_uid == os.getuid():
                runs.setdefault(parts[1], []).append(name)
        except FileNotFoundError:
            pass
    return runs


def orphaned() -> dict[str, list[str]]:
    """{run id: its region names} of this user's runs whose server is gone: the run's lock file
    exists and no live process holds it. Regions without a lock file are never judged."""
    dead = {}
    for run, names in _runs().items():
        fd = _try_lock(_lock_path(run), create=False)
        if fd is not None:
            os.close(fd)
            dead[run] = names
    return dead


def remove_orphans() -> dict[str, tuple[int, int]]:
    """Remove what ``orphaned`` finds, holding each dead run's lock while its regions go (so a
    new server of the same run id cannot start in between); {run id: (regions, bytes)}."""
    out = {}
    for run, names in _runs().items():
        lock = _lock_path(run)
        fd = _try_lock(lock, create=False)
        if fd is None:
            continue
        try:
            size = 0
            for name in names:
                try:
                    size += os.path.getsize(os.path.join(SHM_DIR, name))
                except OSError:
                    pass
            out[run] = (len(_unlink(names, keep=os.path.basename(lock))), size)
            try:
                os.unlink(lock)
            except FileNotFoundError:
                pass
        finally:
            os.close(fd)
    return out
