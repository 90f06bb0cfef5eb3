"""What the core answers: replies addressed to a peer (its ZeroMQ routing identity)."""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from dataclasses import dataclass

from protocol.messages import Error, Message

from .errors import RequestError


@dataclass(frozen=True)
class Out:
    """A reply to send: to ``peer``, ``msg`` with tensor ``frames``."""

    peer: bytes
    msg: Message
    frames: tuple = ()


def error_out(peer: bytes, req_id: int, code: str, message: str, field: str = "") -> Out:
    return Out(peer, Error(req_id=req_id, code=code, message=message, field=field))


class Duplicate(RequestError):
    """A request numbered as one of its connection's still waiting: its refusal answers only
    itself, not the waiting one."""


class Waiting:
    """Requests of each connection that are answered later (a Fetch for a version not there
    yet, a gradient being reduced, a checkpoint). A connection may have at most ``limit``: a
    peer that floods the server cannot make it hold unbounded state for it."""

    def __init__(self, limit: int):
        self.limit = limit
        self._by_peer: dict[bytes, set[int]] = {}

    def check(self, peer: bytes, req_id: int, bounded: bool = True) -> None:
        """Refuse a request numbered as one still waiting, and (``bounded``) one beyond the
        limit."""
        waiting = self._by_peer.get(peer, ())
        if req_id in waiting:  # (counted once, it would let a peer park any number)
            raise Duplicate("bad_request", f"request {req_id} of this connection is still "
                               "waiting for its reply: a req_id is reused once answered",
                               "req_id")
        if bounded and len(waiting) >= self.limit:
            raise RequestError("busy", f"{self.limit} requests of this connection are waiting "
                               "for their replies; send more once they came")

    def note(self, peer: bytes, req_id: int, outs: list[Out]) -> None:
        """``outs`` are the replies due now; without one to ``req_id``, it waits."""
        if not any(o.peer == peer and o.msg.req_id == req_id for o in outs):
            self._by_peer.setdefault(peer, set()).add(req_id)

    def forget(self, peer: bytes) -> None:
        """The peer is gone: its waiting requests are answered to nobody."""
        self._by_peer.pop(peer, None)

    def answered(self, outs: list[Out]) -> list[Out]:
        for o in outs:
            waiting = self._by_peer.get(o.peer)
            if waiting is not None:
                waiting.discard(o.msg.req_id)
                if not waiting:
                    del self._by_peer[o.peer]
        return outs


class Copies:
    """Frames made for a peer (a layer's fp32 master assembled from two regions) that ZeroMQ
    has not let go of yet: a peer asking for them without reading its replies made the server
    hold one per request (500 Fetches of a 4 MB layer: +2 GB). At most ``limit`` each; more
    get ``busy``. Released from ZeroMQ's thread: under a lock."""

    def __init__(self, limit: int = 8):
        self.limit = limit
        self._by_peer: Counter[bytes] = Counter()
        self._lock = threading.Lock()

    def check(self, peer: bytes) -> None:
        if self._by_peer[peer] >= self.limit:
            raise RequestError("busy", f"{self.limit} copies of layers made for this "
                               "connection are not yet sent: read them first")

    def track(self, peer: bytes, made) -> None:
        """``made`` (a tensor in a reply's frame) is counted until it is freed."""
        with self._lock:
            self._by_peer[peer] += 1
        weakref.finalize(made, self._freed, peer)

    def _freed(self, peer: bytes) -> None:
        with self._lock:
            self._by_peer[peer] -= 1
            if self._by_peer[peer] <= 0:
                del self._by_peer[peer]
