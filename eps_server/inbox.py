"""What a peer's messages may cost the EPS before they are served, whatever the peer sends.

A large body (only a Hello's manifest may be large) is decoded off the loop, on one decoder
thread, so the loop goes on serving everyone else. While that peer's message is read, its next
ones wait in its backlog, PEER_BACKLOG at most (requests are taken in order); more are refused
as busy, unread. A peer's large bodies are paced: after one that took t s to decode, its next
is decoded t * PACE s later at the earliest, so one peer keeps the decoder (and a CPU) busy
1 / (1 + PACE) of the time at most, and all peers together one thread. A flood of the same
manifest costs one decode (see codec._Known). python -m bench flood measures a job's step time
during a flood of Hellos of 1.3 MB manifests from a local peer.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from protocol import codec
from protocol.messages import Message

log = logging.getLogger("eps_server")

OFF_LOOP_BYTES = 64 << 10  # bodies larger than this are decoded on the decoder thread
PEER_BACKLOG = 16  # a peer's messages held behind one read off the loop; more are "busy"
PACE = 4.0  # a peer's next large body waits PACE times as long as its last one took
PACED_KEPT = 1024  # peers whose next large body must wait, remembered before a clean-up


def large(frames: list) -> bool:
    return len(frames) > 1 and len(frames[1]) > OFF_LOOP_BYTES


class Throttled:
    """Warnings a peer can cause at will (undecodable messages): at most ``burst`` lines per
    ``window`` s, then a count of those left out (stats.bad_messages counts them all), so a
    flood of garbage does not flood the log."""

    def __init__(self, burst: int = 10, window: float = 10.0):
        self.burst, self.window = burst, window
        self.start, self.count, self.dropped = -math.inf, 0, 0  # a window opens at a warning

    def warn(self, fmt: str, *args) -> None:
        now = time.monotonic()
        if now - self.start > self.window:
            if self.dropped:
                log.warning("%d more bad messages in %.0f s not logged", self.dropped,
                            now - self.start)
            self.start, self.count, self.dropped = now, 0, 0
        if self.count < self.burst:
            self.count += 1
            log.warning(fmt, *args)
        else:
            self.dropped += 1


class Inbox:
    """The peers' backlogs, the decoder thread and its pacing (used on the loop only: the
    server awaits what takes time)."""

    def __init__(self):
        self.backlogs: dict[bytes, deque] = {}  # peer -> its messages, the first being read
        self._due: dict[bytes, float] = {}  # peer -> when its next large body may be decoded
        self._decoder = ThreadPoolExecutor(1, thread_name_prefix="eps-decode")

    def full(self, backlog: deque) -> bool:
        return len(backlog) > PEER_BACKLOG

    def wait(self, identity: bytes) -> float:
        """Seconds this peer's next large body waits before it is decoded."""
        return self._due.get(identity, 0.0) - time.monotonic()

    def decode(self, frames: list) -> Future:
        """``codec.decode`` on the decoder thread; its result goes to ``decoded``."""
        return self._decoder.submit(_timed_decode, frames)

    def decoded(self, identity: bytes, result) -> tuple[Message, list]:
        """The decoded message, charged to the peer's pace. Raises codec.DecodeError."""
        decoded, took = result
        if len(self._due) >= PACED_KEPT:
            now = time.monotonic()
            self._due = {peer: due for peer, due in self._due.items() if due > now}
        self._due[identity] = time.monotonic() + took * PACE
        if isinstance(decoded, codec.DecodeError):
            raise decoded
        return decoded

    def close(self) -> None:
        self._decoder.shutdown(wait=False, cancel_futures=True)


def _timed_decode(frames: list):
    """(the decoded message, or its DecodeError; seconds it took). The garbage collector is off
    meanwhile: a manifest's many short-lived maps and lists would set off full collections,
    each a pause of every thread (~0.1 s with torch loaded) that the loop would wait out, for
    nothing: decoded msgpack holds no reference cycles, counting references frees it all."""
    t0 = time.perf_counter()
    collecting = gc.isenabled()
    gc.disable()
    try:
        decoded = codec.decode(frames)
    except codec.DecodeError as e:
        decoded = e
    finally:
        if collecting:
            gc.enable()
    return decoded, time.perf_counter() - t0
