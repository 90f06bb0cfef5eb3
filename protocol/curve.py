"""ZeroMQ CURVE authentication for tcp endpoints: key files, and what each side sets.

Keys are libzmq's Z85 certificate files as ``zmq.auth`` writes them (``l2l-ctl keygen DIR
NAME`` makes ``NAME.key``, the public one, and ``NAME.key_secret``, mode 0600, which holds both
halves). The EPS takes its secret file and a directory of allowed clients' public files; a
client takes the EPS's public file and its own secret file. Every message of an authenticated
connection carries its client's public key (the ZAP "User-Id"), which the EPS uses to tell
a worker's reconnection from someone else taking its rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

# What a client's socket monitor reports when a security handshake fails.
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def handshake_failure(event: int, has_keys: bool) -> str:
    """What a failed handshake (a HANDSHAKE_FAILED monitor event) means for this client."""
    if not has_keys:
        return ("the EPS requires CURVE: give its public key (--curve-server-key) and this "
                "client's secret key (--curve-key)")
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return ("the EPS refused this client's CURVE key: its public half is not among the "
                "EPS's allowed clients (--curve-clients)")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return "the CURVE handshake failed: the EPS does not use CURVE, or speaks another protocol"
    return "the CURVE handshake failed: wrong server key (--curve-server-key is not the EPS's)?"


@dataclass(frozen=True)
class ClientKeys:
    server_public: bytes
    public: bytes
    secret: bytes

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


def generate(directory: str, name: str) -> tuple[str, str]:
    """Write NAME.key (0644) and NAME.key_secret (0600, never readable by others, not even
    while it is written) into ``directory``; returns their paths. Keys there are never
    replaced (the EPS or clients may hold them): FileExistsError."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    for path in (os.path.join(directory, f"{name}.key{end}") for end in ("", "_secret")):
        if os.path.lexists(path):
            raise FileExistsError(f"{path} exists: keys are not replaced; remove them first, "
                                  "or give another name")
    old = os.umask(0o077)  # (the library writes them with the process's umask)
    try:
        public, secret = zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old)
    os.chmod(public, 0o644)
    return public, secret


def load_secret(path: str) -> tuple[bytes, bytes]:
    """(public, secret) from a secret key file; ValueError if it is not one or others may
    read it."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the CURVE key {path}: {e}") from None
    if secret is None:
        raise ValueError(f"{path} holds a public key only; give the secret key file "
                         "(NAME.key_secret)")
    if os.stat(path).st_mode & 0o077:
        raise ValueError(f"{path}: a secret key must be readable by its owner only (chmod 600)")
    return public, secret


def load_public(path: str) -> bytes:
    try:
        return zmq.auth.load_certificate(path)[0]
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the CURVE key {path}: {e}") from None


def client_keys(server_key: str, key: str) -> ClientKeys | None:
    """A client's keys from its options (both or neither)."""
    if not server_key and not key:
        return None
    if not (server_key and key):
        raise ValueError("CURVE needs both the server's public key and this client's secret key")
    public, secret = load_secret(key)
    return ClientKeys(load_public(server_key), public, secret)


def check_clients_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise ValueError(f"the allowed-clients directory {path} does not exist")
    if not any(n.endswith(".key") for n in os.listdir(path)):
        raise ValueError(f"{path} holds no public key (*.key): no client could connect")


def check_server_options(secret_key: str, clients: str) -> None:
    """Both or neither; readable; ValueError naming the problem otherwise."""
    if bool(secret_key) != bool(clients):
        raise ValueError("CURVE needs both --curve-secret-key and --curve-clients")
    if secret_key:
        load_secret(secret_key)
        check_clients_dir(clients)


def serve(ctx: zmq.Context, sock: zmq.Socket, secret_key: str, clients: str
          ) -> ThreadAuthenticator:
    """Make ``sock`` a CURVE server that accepts only the public keys in ``clients`` (read
    once, now). The ZAP handler runs on its own thread (handshakes never touch the caller's
    event loop); stop it after closing ``sock``."""
    public, secret = load_secret(secret_key)
    check_clients_dir(clients)
    auth = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying))  # a plain (not asyncio) twin
    auth.start()
    auth.configure_curve(domain="*", location=clients)
    sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.curve_server = True
    return auth


def peer_key(frames: list) -> bytes:
    """The authenticated client's public key (Z85) of a received message, b"" without CURVE."""
    try:
        return frames[-1].get("User-Id").encode()
    except (zmq.ZMQError, AttributeError, IndexError):
        return b""
