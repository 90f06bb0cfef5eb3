"""Gradient buffers the EPS holds only while it needs them.

A layer's gradient normally never gets a buffer: its update reads the ranks' pushed parts
where they lie (their shared-memory slots or received frames). A buffer is taken only to
*keep* a step's gradient until the step is decided (global-norm clipping, fp16 overflow skips,
deferred updates: scheduler.py) and as the fp32 gradient of an optimizer without a fused
kernel (LAMB, SGD), and given back as soon as that is over. Buffers of one (dtype, size) are
kept for reuse: the EPS's memory holds the most that were in use at once (every layer's, with
deferred updates), not one per layer for good.
"""

from __future__ import annotations

import threading

import torch


class BufferPool:
    def __init__(self):
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.in_use_bytes = 0
        self.peak_bytes = 0  # the most held at once (what the pool costs the EPS)
        self.allocated_bytes = 0

    def take(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A flat buffer of ``numel`` elements (contents undefined)."""
        with self._lock:
            free = self._free.get((dtype, numel))
            buf = free.pop() if free else None
            nbytes = numel * dtype.itemsize
            self.in_use_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.in_use_bytes)
            if buf is None:
                self.allocated_bytes += nbytes
        return buf if buf is not None else torch.empty(numel, dtype=dtype)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self.in_use_bytes -= buf.numel() * buf.element_size()
            self._free.setdefault((buf.dtype, buf.numel()), []).append(buf)

    def trim(self) -> None:
        """Free the buffers not in use (e.g. after a deferred step's peak)."""
        with self._lock:
            for bufs in self._free.values():
                self.allocated_bytes -= sum(b.numel() * b.element_size() for b in bufs)
            self._free.clear()
