"""ZeroMQ endpoints: the default address and the bind-time security rules.

- Default: an ipc:// socket in a per-user directory with mode 0700, so only this user can
  connect (file permissions are the authentication on one box).
- tcp:// binds are allowed on loopback only. Binding a routable address would expose a port
  that accepts unauthenticated control of the training state, so it is refused.
"""

from __future__ import annotations

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


def check_bind(endpoint: str) -> None:
    """Raise ValueError if binding ``endpoint`` would break the security defaults; for ipc://,
    create its directory (mode 0700) and refuse a directory other users can enter."""
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
        return
    if endpoint.startswith("tcp://"):
        host = urlsplit(endpoint).hostname or ""
        if not is_loopback_host(host):
            raise ValueError(
                f"refusing to bind {endpoint}: tcp on a non-loopback address would accept "
                "unauthenticated peers; bind 127.0.0.1 or an ipc:// path")
        return
    raise ValueError(f"unsupported endpoint {endpoint!r}: use ipc:///path or tcp://127.0.0.1:PORT")


def check_connect(endpoint: str) -> None:
    """Raise ValueError if the ipc socket to connect to lies in a directory that another user
    owns or that others can enter: whoever listens there could be anyone (a client sends its
    Hello, manifest included, to whoever answers)."""
    if not endpoint.startswith("ipc://"):
        return
    parent = os.path.dirname(endpoint[len("ipc://"):])
    try:
        st = os.stat(parent)
    except FileNotFoundError:
        return  # nothing listens there yet; the connection will wait (and time out)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ValueError(f"refusing to connect to {endpoint}: its directory {parent} must be "
                         "owned by this user with mode 0700")


def remove_ipc(endpoint: str) -> None:
    """Remove an ipc socket file left behind (ZeroMQ does not always unlink it)."""
    if endpoint.startswith("ipc://"):
        try:
            os.unlink(endpoint[len("ipc://"):])
        except OSError:
            pass
