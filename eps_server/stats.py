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
    """Time the engines spent reading the pushed gradients (finiteness, norm) before an
    update."""
    update_seconds: float = 0.0
    """Time the engines spent updating (rollbacks and kept gradients included)."""
    updates: int = 0
    """Layer version advances (skipped updates included)."""
    clipped_steps: int = 0
    """Steps whose global gradient norm was clipped (--clip-norm)."""
    rollbacks: int = 0
    """Speculative layer updates taken back (and redone with the step's clipping, or left out
    of a skipped step)."""
    rollback_seconds: float = 0.0
    """Time the engines spent taking speculative updates back and redoing them."""
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
    checkpoints_written: int = 0
    """Checkpoints written (periodic, asked for with Save, and the final one)."""
    checkpoint_failures: int = 0
    """Checkpoints that could not be written (a full or read-only disk): the previous one
    stands, the next is tried again."""
    last_checkpoint_step: int = -1
    """Step of the last checkpoint written (-1: none yet)."""
    reducing: int = 0
    """Gradients accepted and not yet acknowledged (all ranks): held until every rank's part
    of their layer is in and its update has read them."""

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


def model_memory(store, optimizers, buffers, rss_before: int = 0) -> dict:
    """What the EPS holds for the model: the store's regions (master, compute copy,
    --recovery's copy), the optimizer state, and the most gradient bytes kept at once
    (buffers.py), in all and per parameter; with ``rss_before`` (the resident memory before the
    model), the growth of the peak resident memory per parameter (measured: transients and
    allocator slack included)."""
    params = max(1, store.manifest.num_params)
    regions = sum(r.nbytes for r in (store.master_region, store.compute_region,
                                     store.retained_region) if r is not None)
    state = sum(t.numel() * t.element_size() for opt in optimizers
                for t in opt.state_tensors().values())
    kept = buffers.peak_bytes
    out = {"model_bytes": regions + state, "kept_peak_bytes": kept,
           "bytes_per_param": round((regions + state + kept) / params, 3)}
    peak = peak_memory_bytes().get("vmhwm_bytes", 0)
    if peak and rss_before:
        out["rss_growth_per_param"] = round((peak - rss_before) / params, 3)
    return out
