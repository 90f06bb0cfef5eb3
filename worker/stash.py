"""Where boundary activations (each block's input, per micro-batch) wait between the forward and
the backward of a step. Only layer boundaries are kept; everything inside a layer is recomputed.
A boundary is a tensor or a tuple of tensors; each member is stored as it is.

    device  on the compute device: fastest; device memory grows with depth x micro-batches
    host    in the worker's pinned host memory (CUDA; copies on a side stream); on CPU the
            device *is* host memory, so this is the device stash
    eps     in an EPS-owned shared-memory arena: the worker's own memory does not grow with
            depth on CPU either (the arena is the EPS's, sized by this worker)

``put`` returns the boundary the forward should go on reading (the stored copy when it lives in
host memory the compute can read directly, so the private original can be freed at once).
"""

from __future__ import annotations

from collections import deque

import torch

from .streams import Streams

ENTRY_ALIGN = 256


def members(x) -> tuple[torch.Tensor, ...]:
    """The tensors of a boundary."""
    return x if isinstance(x, tuple) else (x,)


def shaped_like(x, parts):
    """``parts`` in the structure of boundary ``x`` (a tuple, or the one tensor)."""
    return tuple(parts) if isinstance(x, tuple) else parts[0]


class _InFlight:
    """Device tensors whose copy out runs on a side stream: each is kept alive until its copy
    is done (the caching allocator would otherwise hand its memory to the compute stream,
    which the side-stream copy is not ordered against)."""

    def __init__(self):
        self._q: deque = deque()

    def add(self, event, tensor: torch.Tensor) -> None:
        self._q.append((event, tensor))
        while self._q and self._q[0][0].query():
            self._q.popleft()

    def clear(self) -> None:
        for event, _ in self._q:
            event.synchronize()
        self._q.clear()


class DeviceStash:
    def __init__(self):
        self._store: dict[tuple[int, int], object] = {}

    def put(self, layer: int, micro_batch: int, x):
        self._store[layer, micro_batch] = x
        return x

    def pop(self, layer: int, micro_batch: int):
        return self._store.pop((layer, micro_batch))

    def clear(self) -> None:
        self._store.clear()


class HostStash:
    """CUDA: pinned host buffers, one per (layer, micro-batch, member), kept across steps. The
    copy out runs on a side stream behind the forward's event; the copy back waits for it."""

    def __init__(self, streams: Streams):
        self.streams = streams
        self._host: dict[tuple[int, int, int], torch.Tensor] = {}
        self._copied: dict[tuple[int, int], object] = {}
        self._shapes: dict[tuple[int, int], object] = {}  # each boundary's structure
        self._inflight = _InFlight()

    def put(self, layer: int, micro_batch: int, x):
        key = (layer, micro_batch)
        produced = self.streams.event()
        with self.streams.on(self.streams.d2h):
            self.streams.wait(produced, self.streams.d2h)
            self.streams.stall("d2h", self.streams.d2h)
            for j, t in enumerate(members(x)):
                host = self._host.get((*key, j))
                if host is None or host.shape != t.shape or host.dtype != t.dtype:
                    host = self._host[(*key, j)] = torch.empty(t.shape, dtype=t.dtype,
                                                             pin_memory=True)
                host.copy_(t, non_blocking=True)
            self._copied[key] = self.streams.event(self.streams.d2h)
        for t in members(x):
            self._inflight.add(self._copied[key], t)
        self._shapes[key] = shaped_like(x, [None] * len(members(x)))  # not x: it may go
        return x

    def pop(self, layer: int, micro_batch: int):
        key = (layer, micro_batch)
        self.streams.wait(self._copied.pop(key))
        x = self._shapes.pop(key)
        return shaped_like(x, [self._host[(*key, j)].to(self.streams.device, non_blocking=True)
                               for j in range(len(members(x)))])

    def clear(self) -> None:
        self._copied.clear()
        self._shapes.clear()
        self._inflight.clear()


class EpsStash:
    """Entries in an arena of EPS-owned shared memory, one per (block, micro-batch); the
    stashed layers are 1..``layers`` (the blocks). The arena is requested on the first put,
    sized for the whole depth from that first boundary (boundaries of a layered model all have
    one shape); each member of an entry starts at a multiple of 256 bytes."""

    def __init__(self, source, streams: Streams, layers: int, micro_batches: int):
        self.source = source
        self.streams = streams
        self.layers = layers
        self.micro_batches = micro_batches
        self.region = None
        self.entry_bytes = 0
        self._members: list[tuple[int, int]] = []  # (byte offset in the entry, bytes) each
        self._stored: dict[tuple[int, int], tuple[object, object]] = {}
        self._inflight = _InFlight()

    def _slots(self, layer: int, micro_batch: int, x) -> list[torch.Tensor]:
        parts = members(x)
        if self.region is None:
            offset = 0
            for t in parts:
                nbytes = t.numel() * t.element_size()
                self._members.append((offset, nbytes))
                offset += -(-nbytes // ENTRY_ALIGN) * ENTRY_ALIGN
            self.entry_bytes = offset
            self.region = self.source.stash_arena(
                self.entry_bytes * self.layers * self.micro_batches)
        if len(parts) != len(self._members) or any(
                t.numel() * t.element_size() > nbytes
                for t, (_, nbytes) in zip(parts, self._members)):
            raise RuntimeError(f"stash entry of {[tuple(t.shape) for t in parts]} exceeds the "
                               "arena's: activations of varying size need --stash device or "
                               "host")
        base = ((layer - 1) * self.micro_batches + micro_batch) * self.entry_bytes
        return [self.region.tensor(t.dtype, (base + offset) // t.element_size(),
                                   t.numel()).view(t.shape)
                for t, (offset, _) in zip(parts, self._members)]

    def put(self, layer: int, micro_batch: int, x):
        slots = self._slots(layer, micro_batch, x)
        if not self.streams.cuda:
            for slot, t in zip(slots, members(x)):
                slot.copy_(t)
            stored = shaped_like(x, slots)
            self._stored[layer, micro_batch] = (stored, None)
            return stored  # the forward reads the arena copy; the private x can go
        produced = self.streams.event()
        with self.streams.on(self.streams.d2h):
            self.streams.wait(produced, self.streams.d2h)
            self.streams.stall("d2h", self.streams.d2h)
            for slot, t in zip(slots, members(x)):
                slot.copy_(t, non_blocking=True)
            copied = self.streams.event(self.streams.d2h)
        self._stored[layer, micro_batch] = (shaped_like(x, slots), copied)
        for t in members(x):
            self._inflight.add(copied, t)
        return x

    def pop(self, layer: int, micro_batch: int):
        stored, copied = self._stored.pop((layer, micro_batch))
        if not self.streams.cuda:
            return stored
        self.streams.wait(copied)
        return shaped_like(stored, [t.to(self.streams.device, non_blocking=True)
                                    for t in members(stored)])

    def clear(self) -> None:
        self._stored.clear()
        if self.streams.cuda:
            self._inflight.clear()


STASHES = ("device", "host", "eps")


def make_stash(kind: str, source, streams: Streams, layers: int, micro_batches: int):
    """``layers``: how many layers are stashed (the blocks, 1..layers)."""
    if kind == "device" or (kind == "host" and not streams.cuda):
        return DeviceStash()
    if kind == "host":
        return HostStash(streams)
    if kind == "eps":
        return EpsStash(source, streams, layers, micro_batches)
    raise ValueError(f"unknown stash placement {kind!r}; expected one of {STASHES}")
