"""Who is connected: the registered workers (one per rank) and observers, when each was last
heard from, and the checks every Hello passes.

A rank is held by one connection. A Hello for a rank another connection holds is refused
("rank_taken") while that one is alive, i.e. was heard from within the heartbeat timeout;
once it is silent for longer it is declared dead (``expire``) and the rank is free for a
replacement. A holder whose process is seen to have exited (same machine and PID namespace as
the EPS: ``lifecycle.process_gone``) is declared dead at once. A Hello may ask for any rank
(ANY_RANK): it gets the lowest free one. Observers (control clients) hold no rank and evict
nobody.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from protocol.lifecycle import process_alive, process_gone
from protocol.messages import PROTOCOL_VERSION, Hello, WorkerReport
from protocol.tensors import manifest_difference

from .config import ServerConfig
from .errors import RequestError
from .layer_store import LayerStore

log = logging.getLogger("eps_server")


@dataclass
class Peer:
    identity: bytes  # the ZeroMQ routing identity of its connection
    rank: int  # -1: an observer
    transport: object  # transports.ShmTransport | FramesTransport: how tensors move
    grad_dtype: str
    pid: int
    key: bytes = b""  # its CURVE public key (tcp with authentication), else empty
    last_seen: float = 0.0
    host: str = ""
    report: WorkerReport | None = None  # a worker's latest (its heartbeats)
    process: str = ""  # its Hello's process identity (lifecycle.process_identity)

    @property
    def worker(self) -> bool:
        return self.rank >= 0

    @classmethod
    def observer(cls, identity: bytes, pid: int, key: bytes) -> Peer:
        """A control client: no rank, no transport."""
        return cls(identity, -1, None, "", pid, key)


class Peers:
    def __init__(self, world_size: int, timeout: float,
                 clock: Callable[[], float] = time.monotonic):
        self.world_size, self.timeout, self.clock = world_size, timeout, clock
        self._by_identity: dict[bytes, Peer] = {}
        self.done_ranks: set[int] = set()
        self.ever: set[int] = set()  # ranks held at some time in this run
        self._exited: dict[bytes, int] = {}  # connection -> rank of holders whose process exited

    def get(self, identity: bytes) -> Peer:
        peer = self._by_identity.get(identity)
        if peer is None:
            raise RequestError("not_registered", "say Hello first")
        return peer

    def worker(self, identity: bytes) -> Peer:
        peer = self.get(identity)
        if not peer.worker:
            raise RequestError("bad_request", "an observer sends no worker requests")
        return peer

    def __contains__(self, identity: bytes) -> bool:
        return identity in self._by_identity

    def seen(self, identity: bytes) -> None:
        peer = self._by_identity.get(identity)
        if peer is not None:
            peer.last_seen = self.clock()

    def excuse(self, seconds: float) -> None:
        """The EPS itself did not run for ``seconds`` (stopped, paused, starved): what peers
        sent meanwhile is still unread, so that time does not count as their silence."""
        now = self.clock()
        for p in self._by_identity.values():
            p.last_seen = min(now, p.last_seen + seconds)

    def snapshot(self) -> list[Peer]:
        """The registered peers (safe from another thread: one C-level copy)."""
        return list(self._by_identity.values())

    def holder(self, rank: int) -> Peer | None:
        return next((p for p in self._by_identity.values() if p.rank == rank), None)

    def free_rank(self, identity: bytes) -> int:
        """The rank for a Hello asking for any (ANY_RANK): the one this connection holds
        already, else the lowest rank neither held by a live connection nor finished (so a
        replica restarted after a death takes the dead one's rank). Silent holders are gone
        already (``expire``)."""
        own = self._by_identity.get(identity)
        if own is not None and own.worker:
            return own.rank
        held = {p.rank for p in self._by_identity.values() if p.worker} | self.done_ranks
        free = next((r for r in range(self.world_size) if r not in held), None)
        if free is None:
            raise RequestError("rank_taken", f"all {self.world_size} ranks are held by live "
                               "connections or finished; a rank is freed once its holder has "
                               f"been silent for {self.timeout:g} s")
        return free

    def expire(self) -> list[tuple[Peer, str]]:
        """Remove and return the peers declared dead, each with why: silent for longer than the
        timeout, or (workers) their process has exited."""
        now = self.clock()
        dead = []
        for p in list(self._by_identity.values()):
            if now - p.last_seen > self.timeout:
                dead.append((p, f"nothing heard for {self.timeout:g} s"))
            elif p.worker and p.process and process_gone(p.process):
                dead.append((p, f"its process (pid {p.pid}) has exited"))
                self._exited[p.identity] = p.rank  # its Bye may still be on the way
            else:
                continue
            del self._by_identity[p.identity]
        return dead

    def late_bye(self, identity: bytes, rank: int, done: bool) -> bool:
        """A Bye that arrives after its sender's process was seen to exit (the EPS read it
        late): its rank counts as done if nobody took it over since. False if ``identity`` is
        no such connection."""
        if self._exited.get(identity) != rank:
            return False
        del self._exited[identity]
        if done and self.holder(rank) is None:
            self.done_ranks.add(rank)
        return True

    def check_free(self, rank: int, identity: bytes, key: bytes,
                   process: str = "") -> Peer | None:
        """Refuse a Hello for ``rank`` while a live connection holds it, unless the Hello comes
        over that same connection or with the same CURVE key (a worker that reconnected: the
        returned holder is replaced) from the same process or while the holder's process is not
        seen alive (a launcher may give several workers one key). Silent holders and exited
        processes are gone already (``expire``)."""
        old = self.holder(rank)
        if old is None or old.identity == identity:
            return None
        if key and key == old.key:
            if process != old.process and process_alive(old.process):
                raise RequestError("rank_taken", f"rank {rank} is held by another live process "
                                   f"(pid {old.pid}) with this key; it is replaced once it "
                                   f"has exited or been silent for {self.timeout:g} s")
            return old
        raise RequestError("rank_taken", f"rank {rank} is held by a live connection (pid "
                           f"{old.pid}); a replacement is accepted once it has been silent "
                           f"for {self.timeout:g} s")

    def register(self, peer: Peer) -> Peer | None:
        """Register ``peer`` (see ``check_free``); returns the connection it replaced."""
        old = (self.check_free(peer.rank, peer.identity, peer.key, peer.process)
               if peer.worker else None)
        if old is not None:
            log.warning("rank %d reconnected with its key (pid %d replaces pid %d)", peer.rank,
                        peer.pid, old.pid)
            del self._by_identity[old.identity]
        peer.last_seen = self.clock()
        self._by_identity[peer.identity] = peer
        if peer.worker:
            self.done_ranks.discard(peer.rank)
            self.ever.add(peer.rank)
            # a Bye still queued from an earlier holder of this rank speaks for nobody now
            self._exited = {i: r for i, r in self._exited.items() if r != peer.rank}
        return old

    def leave(self, identity: bytes, done: bool) -> Peer:
        peer = self._by_identity.pop(identity)
        if done and peer.worker:
            self.done_ranks.add(peer.rank)
        return peer

    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(p.rank for p in self._by_identity.values() if p.worker))

    @property
    def all_done(self) -> bool:
        """Every rank said Bye(done=True)."""
        return len(self.done_ranks) >= self.world_size


def check_hello(cfg: ServerConfig, msg: Hello) -> str:
    """The checks every Hello passes, model or not; returns its resolved gradient dtype."""
    if msg.protocol_version != PROTOCOL_VERSION:
        raise RequestError("protocol_version", version_text(msg.protocol_version),
                           "protocol_version")
    if msg.role == "observer":
        return ""
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
    """Control requests (Save, SetHyper) come from a peer that said Hello (a worker, or an
    observer: with CURVE, one holding an allowed key), or over ipc, where the socket directory's
    permissions already restrict peers to this user."""
    if not registered and not cfg.endpoint.startswith("ipc://"):
        raise RequestError("not_registered", "control requests over tcp need a Hello first")


def check_one_box(cfg: ServerConfig, what: str) -> None:
    """``l2l-ctl save`` and ``set`` act on one EPS; with several boxes that would park this
    box's engines while the others wait in their collectives (save), or make the boxes update
    with different settings (set: replicas that differ, or shards updated unlike each other)."""
    if cfg.boxes.nodes > 1:
        raise RequestError("bad_request", f"a job over {cfg.boxes.nodes} boxes cannot {what} "
                           "on one box: " + ("its boxes checkpoint together (--checkpoint-every, "
                                             "and at exit)" if what == "save" else
                                             "restart it from a checkpoint with the new settings"))
