"""Who is connected: the registered workers (one per rank) and the checks every Hello passes."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from protocol.messages import PROTOCOL_VERSION, Hello
from protocol.tensors import manifest_difference

from .config import ServerConfig
from .errors import RequestError
from .layer_store import LayerStore

log = logging.getLogger("eps_server")


@dataclass
class Peer:
    identity: bytes  # the ZeroMQ routing identity of its connection
    rank: int
    transport: object  # transports.ShmTransport | FramesTransport: how tensors move
    grad_dtype: str
    pid: int


class Peers:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self._by_identity: dict[bytes, Peer] = {}
        self.done_ranks: set[int] = set()

    def get(self, identity: bytes) -> Peer:
        peer = self._by_identity.get(identity)
        if peer is None:
            raise RequestError("not_registered", "say Hello first")
        return peer

    def __contains__(self, identity: bytes) -> bool:
        return identity in self._by_identity

    def register(self, peer: Peer) -> list[bytes]:
        """Register ``peer``; returns the identities of older connections of its rank, which
        are dropped (a restarted worker replaces its predecessor)."""
        evicted = []
        for identity, old in list(self._by_identity.items()):
            if old.rank == peer.rank and identity != peer.identity:
                log.warning("rank %d reconnected (pid %d replaces pid %d)", peer.rank, peer.pid,
                            old.pid)
                del self._by_identity[identity]
                evicted.append(identity)
        self._by_identity[peer.identity] = peer
        self.done_ranks.discard(peer.rank)
        return evicted

    def leave(self, identity: bytes, done: bool) -> Peer:
        peer = self._by_identity.pop(identity)
        if done:
            self.done_ranks.add(peer.rank)
        return peer

    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(p.rank for p in self._by_identity.values()))

    @property
    def all_done(self) -> bool:
        """Every rank said Bye(done=True)."""
        return len(self.done_ranks) >= self.world_size


def check_hello(cfg: ServerConfig, msg: Hello) -> str:
    """The checks every Hello passes, model or not; returns its resolved gradient dtype."""
    if msg.protocol_version != PROTOCOL_VERSION:
        raise RequestError("protocol_version", version_text(msg.protocol_version),
                           "protocol_version")
    if msg.world_size != cfg.world_size:
        raise RequestError("bad_request", f"server world size is {cfg.world_size}, worker says "
                           f"{msg.world_size}", "world_size")
    grad_dtype = cfg.compute_dtype if msg.grad_dtype == "compute" else msg.grad_dtype
    if grad_dtype not in ("float32", cfg.compute_dtype):
        raise RequestError("bad_request", f"grad_dtype must be float32 or {cfg.compute_dtype}",
                           "grad_dtype")
    return grad_dtype


def check_model(store: LayerStore, msg: Hello) -> None:
    """A Hello must describe the model the server holds; the refusal spells out the first
    difference when the Hello carried its manifest."""
    if msg.manifest_hash == store.manifest_hash:
        return
    head = (f"model mismatch: the server holds {store.manifest_hash[:19]}.. ({store.num_layers} "
            f"layers, {store.manifest.num_params} params), worker rank {msg.rank} has "
            f"{msg.manifest_hash[:19]}..")
    diff = manifest_difference(store.manifest, msg.manifest) if msg.manifest else ""
    raise RequestError("manifest_mismatch", f"{head}: {diff}" if diff else head,
                       "manifest_hash")


def version_text(client_version) -> str:
    return (f"server speaks protocol version {PROTOCOL_VERSION}, client sent "
            f"{client_version}: upgrade the older side")


def check_control(cfg: ServerConfig, registered: bool) -> None:
    """Control requests (Save, SetHyper) come from this job's workers, or over ipc, where the
    socket directory's permissions already restrict peers to this user."""
    if not registered and not cfg.endpoint.startswith("ipc://"):
        raise RequestError("not_registered", "control requests over tcp need a Hello first")
