"""Giving the C heap's free pages back on a CPU worker whose memory should stay flat in depth.

A CPU worker's activations live in glibc's heap. Freed chunks between live ones stay resident
until ``malloc_trim`` hands their pages back, and which holes a visit's transients land in
depends on thread timing: the heap's high-water mark is a random walk, and its peak over a
step grows with the number of visits, i.e. with depth (about a boundary per layer over 64
blocks). ``--stash eps`` exists to keep the worker's private memory flat in depth on the CPU,
so there the worker trims every 4 visits; trimming costs the page faults of touching the
returned pages again (BERT H=128, 16 blocks, 2 MiB boundaries: 3-17% of the speed every 4
visits, 25% every visit), so it is not done elsewhere. On CUDA, or without glibc, nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("l2l_worker")


def _glibc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # musl, macOS: no malloc_trim
        return None


class HeapTrimmer:
    """``tick()`` at every visit; every ``every``-th trims (``every`` 0: never)."""

    def __init__(self, every: int):
        self._libc = _glibc() if every > 0 else None
        self.every = every if self._libc is not None else 0
        self.trims = 0
        self._visits = 0

    def tick(self) -> None:
        if not self.every:
            return
        self._visits += 1
        if self._visits % self.every == 0:
            self._libc.malloc_trim(0)
            self.trims += 1


TRIM_EVERY = 4  # visits: `bench memory`'s 64/4-block ratio 0.98-1.00 (1.10-1.20 every 8)


def heap_trimmer(device_type: str, stash: str) -> HeapTrimmer:
    return HeapTrimmer(TRIM_EVERY if device_type == "cpu" and stash == "eps" else 0)
