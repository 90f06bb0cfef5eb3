"""Where boundary activations (each block's input, per micro-batch) wait between the forward and
the backward of a step. Only layer boundaries are kept; everything inside a layer is recomputed.

    device  on the compute device: fastest; device memory grows with depth x micro-batches
    host    in the worker's pinned host memory (CUDA; copies on a side stream); on CPU the
            device *is* host memory, so this is the device stash
    eps     in an EPS-owned shared-memory arena: the worker's own memory does not grow with
            depth on CPU either (the arena is the EPS's, sized by this worker)

``put`` returns the tensor the forward should go on reading (the stored copy when it lives in
host memory the compute can read directly, so the private original can be freed at once).
"""

from __future__ import annotations

from collections import deque

import torch

from .streams import Streams

ENTRY_ALIGN = 256


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
        self._store: dict[tuple[int, int], torch.Tensor] = {}

    def put(self, layer: int, micro_batch: int, x: torch.Tensor) -> torch.Tensor:
        self._store[layer, micro_batch] = x
        return x

    def pop(self, layer: int, micro_batch: int) -> torch.Tensor:
        return self._store.pop((layer, micro_batch))

    def clear(self) -> None:
        self._store.clear()


class HostStash:
    """CUDA: pinned host buffers, one per (layer, micro-batch), kept across steps. The copy out
    runs on a side stream behind the forward's event; the copy back waits for it."""

    def __init__(self, streams: Streams):
        self.streams = streams
        self._host: dict[tuple[int, int], torch.Tensor] = {}
        self._copied: dict[tuple[int, int], object] = {}
        self._inflight = _InFlight()

    def put(self, layer: int, micro_batch: int, x: torch.Tensor) -> torch.Tensor:
        key = (layer, micro_batch)
        host = self._host.get(key)
        if host is None or host.shape != x.shape or host.dtype != x.dtype:
            host = self._host[key] = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        produced = self.streams.event()
        with self.streams.on(self.streams.d2h):
            self.streams.wait(produced, self.streams.d2h)
            host.copy_(x, non_blocking=True)
            self._copied[key] = self.streams.event(self.streams.d2h)
        self._inflight.add(self._copied[key], x)
        return x

    def pop(self, layer: int, micro_batch: int) -> torch.Tensor:
        key = (layer, micro_batch)
        self.streams.wait(self._copied.pop(key))
        return self._host[key].to(self.streams.device, non_blocking=True)

    def clear(self) -> None:
        self._copied.clear()
        self._inflight.clear()


class EpsStash:
    """Entries in an arena of EPS-owned shared memory, one slot per (block, micro-batch); the
    stashed layers are 1..``layers`` (the blocks). The arena is requested on the first put,
    sized for the whole depth from that first entry (boundary activations of a layered model
    all have one shape)."""

    def __init__(self, source, streams: Streams, layers: int, micro_batches: int):
        self.source = source
        self.streams = streams
        self.layers = layers
        self.micro_batches = micro_batches
        self.region = None
        self.entry_bytes = 0
        self._stored: dict[tuple[int, int], tuple[torch.Tensor, object]] = {}
        self._inflight = _InFlight()

    def _slot(self, layer: int, micro_batch: int, x: torch.Tensor) -> torch.Tensor:
        nbytes = x.numel() * x.element_size()
        if self.region is None:
            self.entry_bytes = -(-nbytes // ENTRY_ALIGN) * ENTRY_ALIGN
            self.region = self.source.stash_arena(
                self.entry_bytes * self.layers * self.micro_batches)
        if nbytes > self.entry_bytes:
            raise RuntimeError(f"stash entry of {nbytes} bytes exceeds the arena's "
                               f"{self.entry_bytes}: activations of varying size need "
                               "--stash device or host")
        index = (layer - 1) * self.micro_batches + micro_batch
        start = index * self.entry_bytes // x.element_size()
        return self.region.tensor(x.dtype, start, x.numel()).view(x.shape)

    def put(self, layer: int, micro_batch: int, x: torch.Tensor) -> torch.Tensor:
        slot = self._slot(layer, micro_batch, x)
        if not self.streams.cuda:
            slot.copy_(x)
            self._stored[layer, micro_batch] = (slot, None)
            return slot  # the forward reads the arena copy; the private x can go
        produced = self.streams.event()
        with self.streams.on(self.streams.d2h):
            self.streams.wait(produced, self.streams.d2h)
            slot.copy_(x, non_blocking=True)
            self._stored[layer, micro_batch] = (slot, self.streams.event(self.streams.d2h))
        self._inflight.add(self._stored[layer, micro_batch][1], x)
        return x

    def pop(self, layer: int, micro_batch: int) -> torch.Tensor:
        slot, copied = self._stored.pop((layer, micro_batch))
        if not self.streams.cuda:
            return slot
        self.streams.wait(copied)
        return slot.to(self.streams.device, non_blocking=True)

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
