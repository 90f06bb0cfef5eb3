"""The EPS's statistics: one object with named fields (what StatusReply and metrics report)."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import asdict, dataclass


@dataclass
class EpsStats:
    messages: int = 0
    """Messages received."""
    bad_messages: int = 0
    """Messages that did not decode."""
    fetches: int = 0
    """LayerReady replies sent."""
    pushes: int = 0
    """Gradients accepted (reduced)."""
    bytes_reduced: int = 0
    """Wire bytes of the accepted gradients."""
    reduce_seconds: float = 0.0
    """Time the engines spent reducing."""
    update_seconds: float = 0.0
    """Time the engines spent updating (and measuring gradients for deferred updates)."""
    updates: int = 0
    """Layer version advances (skipped updates included)."""
    steps_completed: int = 0
    """Steps every layer has completed since the server started."""
    overflow_steps: int = 0
    """Steps in which some gradient overflowed (fp16) or had a non-finite norm."""
    skipped_updates: int = 0
    """Layer updates skipped because of an overflow."""
    replies_dropped: int = 0
    """Replies that could not be sent (a peer that does not read them, or is gone)."""
    busy_refusals: int = 0
    """Requests refused because their connection had too many waiting."""
    bytes_served_shm: int = 0
    """Layer bytes served through shared memory (LayerReady naming a region)."""
    bytes_served_frames: int = 0
    """Layer bytes sent as frames."""
    bytes_received_shm: int = 0
    """Gradient bytes read from shared-memory slots (accepted pushes)."""
    bytes_received_frames: int = 0
    """Gradient bytes received as frames (accepted pushes)."""
    reducing: int = 0
    """Gradients accepted and being reduced now (all ranks)."""

    def __post_init__(self) -> None:
        # Not part of snapshot() (StatusReply carries plain numbers): for the metrics.
        self.errors: Counter[str] = Counter()  # Error replies by code
        self.update_latency = Histogram(UPDATE_BUCKETS)  # seconds per layer update

    def snapshot(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


UPDATE_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)


class Histogram:
    """Counts per upper bound (the last counts the rest) and the sum: two additions per
    observation, read by the metrics collector when scraped."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


def peak_memory_bytes() -> dict[str, int]:
    """This process's peak and current resident memory, shared memory included (Linux)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssShmem"):
                    out[f"{key.lower()}_bytes"] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out
