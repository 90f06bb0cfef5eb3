"""ZeroMQ endpoints: the default address and the bind-time security rules.

- Default: an ipc:// socket in a per-user directory with mode 0700, so only this user can
  connect (file permissions are the authentication on one box).
- tcp:// on loopback: any local user can connect (the EPS still refuses a rank held by a live
  worker, and control requests before a Hello). A routable address needs CURVE (protocol/curve.py:
  every peer proves it holds an allowed key), or an explicit --insecure, which is logged.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import tempfile
from urllib.parse import urlsplit


def default_endpoint() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return f"ipc://{base}/l2l-{os.getuid()}/eps.sock"


def is_loopback_host(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(endpoint: str, authenticated: bool = False, insecure: bool = False) -> str | None:
    """Raise ValueError if binding ``endpoint`` would break the security defaults; for ipc://,
    create its directory (mode 0700) and refuse a directory other users can enter. Returns a
    warning to log when ``insecure`` is what allowed the bind."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        if not path.startswith("/"):
            raise ValueError(f"ipc endpoint must be an absolute path: {endpoint}")
        if len(path.encode()) > 100:
            raise ValueError(f"ipc path too long for a unix socket (max ~100 bytes): {path}")
        parent = os.path.dirname(path)
        os.makedirs(parent, mode=0o700, exist_ok=True)
        st = os.stat(parent)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ValueError(f"ipc directory {parent} must be owned by this user with mode 0700")
        return None
    if endpoint.startswith("tcp://"):
        host = urlsplit(endpoint).hostname or ""
        if is_loopback_host(host) or authenticated:
            return None
        if insecure:
            return (f"{endpoint} accepts unauthenticated peers (--insecure): anyone who can "
                    "reach this port can read the model and steer its training")
        raise ValueError(
            f"refusing to bind {endpoint}: tcp on a non-loopback address needs CURVE "
            "authentication (--curve-secret-key and --curve-clients; keys from l2l-ctl keygen), "
            "or --insecure to accept anyone who can reach it; or bind 127.0.0.1 or an ipc:// path")
    raise ValueError(f"unsupported endpoint {endpoint!r}: use ipc:///path or tcp://127.0.0.1:PORT")


def ipv6(endpoint: str) -> bool:
    """An IPv6 address (tcp://[::1]:P): ZeroMQ sockets take one only with the IPV6 option."""
    return endpoint.startswith("tcp://[")


def check_connect(endpoint: str) -> bool:
    """Raise ValueError if the ipc socket to connect to lies in a directory that another user
    owns or that others can enter: whoever listens there could be anyone (a client sends its
    Hello, manifest included, to whoever answers). False while that directory does not exist
    (nothing listens there yet): connect only once it does and passes (else whoever made it
    first, e.g. another user in a shared /tmp, would get the connection)."""
    if not endpoint.startswith("ipc://"):
        return True
    parent = os.path.dirname(endpoint[len("ipc://"):])
    try:
        st = os.stat(parent)
    except FileNotFoundError:
        return False
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ValueError(f"refusing to connect to {endpoint}: its directory {parent} must be "
                         "owned by this user with mode 0700")
    return True


class IpcClaim:
    """The right to serve an ipc:// socket file, held for a server's life: an exclusive flock
    on ``<socket>.lock``. Without it a second server would unlink the first's socket and bind
    its own (ZeroMQ does not refuse), and the first, exiting, would unlink the second's. A
    socket file whose lock nobody holds was left by a server that is gone and is removed.
    tcp:// needs no claim: the port is refused to the second server."""

    def __init__(self, endpoint: str):
        self.path = endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None
        self._fd: int | None = None
        if self.path is None:
            return
        fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise OSError(f"{endpoint} is served by another eps-server (pid {holder}); stop it "
                          "or give this one another --endpoint") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        self._unlink()  # a stale socket file from a killed server

    def _unlink(self) -> None:
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def release(self) -> None:
        """Remove the socket file (ZeroMQ does not always unlink it), then let go (idempotent)."""
        if self._fd is None:
            return
        self._unlink()
        fd, self._fd = self._fd, None
        os.close(fd)  # the lock goes with it; the lock file stays (removing it would race)
