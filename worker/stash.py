"""Where boundary activations (each block's input, per micro-batch) wait between the forward and
the backward of a step. Only layer boundaries are kept; everything inside a layer is recomputed.
A boundary is a tensor or a tuple of tensors; each member is stored as it is.

    device  on the compute device: fastest; device memory grows with depth x micro-batches
    host    in the worker's pinned host memory (CUDA; copies on a side stream); on CPU the
            device *is* host memory, so this is the device stash
    eps     in an EPS-owned shared-memory arena: the worker's own memory does not grow with
            depth on CPU either (the arena is the EPS's, sized by this worker)

``put`` returns the boundary the forward should go on reading (the stored copy when it lives in
host memory the compute can read directly, so the private original can be freed at once);
``fetch`` starts bringing an entry back to the device ahead of its ``pop``.
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
    which the side-stream copy is not ordered against). At most ``limit`` copies stay pending:
    beyond that the host waits for the oldest. Else a forward whose kernels run behind the
    host (a GPU-bound model) would keep every layer's outputs alive, memory growing with depth
    up to what CUDA's launch queue holds."""

    def __init__(self, limit: int):
        self.limit = limit
        self._q: deque = deque()

    def add(self, event, tensors) -> None:
        self._q.append((event, tensors))
        while len(self._q) > self.limit:
            self._q[0][0].synchronize()
            self._q.popleft()
        self.let_go()

    def let_go(self) -> None:
        """Drop the tensors whose copies are done (without waiting for any)."""
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

    def fetch(self, layer: int, micro_batch: int) -> None:
        pass  # already on the device

    def pop(self, layer: int, micro_batch: int):
        return self._store.pop((layer, micro_batch))

    def clear(self) -> None:
        self._store.clear()


class _Staged:
    """CUDA: entries copied out to host memory (``_copy_out``) on the d2h stream behind the
    forward's event, and back (``fetch``) on the stash stream, behind the copy out's event,
    into one of two device buffers used in turn, ahead of the backward that reads them (the
    executor fetches micro-batch i+1 while i computes); ``pop`` makes the compute stream wait
    for the copy. Neither copy holds up the compute stream, and the device holds two entries
    (and the sources of copies out still running: at most two layers' worth).

    A popped entry may be read until the next pop: then the compute stream records that its
    buffer is free (an event the copy that refills it waits for), as FSDP2 does rather than
    ``record_stream``. A host buffer is written again only in the next step, behind an event
    of the compute stream, which by then has waited for every copy back out of it."""

    def __init__(self, streams: Streams, micro_batches: int):
        self.streams = streams
        self._out: dict[tuple[int, int], tuple[object, object]] = {}  # (host copy, copied)
        self._back: dict[tuple[int, int], tuple[int, object, object]] = {}  # buffer, x, landed
        self._buffers: list[list[torch.Tensor]] = [[], []]  # one device tensor per member
        self._freed: list[object] = [None, None]  # compute event after each buffer's last read
        self._next = 0  # the buffer the next fetch fills
        self._reading: int | None = None  # the buffer of the last pop
        self._inflight = _InFlight(2 * micro_batches)  # two layers' entries

    def _copy_out(self, key: tuple[int, int], x, slots: list[torch.Tensor]) -> None:
        s = self.streams
        produced = s.event()
        with s.on(s.d2h):
            s.wait(produced, s.d2h)
            s.stall("d2h", s.d2h)
            for slot, t in zip(slots, members(x)):
                slot.copy_(t, non_blocking=True)
            copied = s.event(s.d2h, host_waits=True)
        self._out[key] = (shaped_like(x, slots), copied)  # not x: it may go
        self._inflight.add(copied, members(x))

    def fetch(self, layer: int, micro_batch: int) -> None:
        """Start copying the entry back to the device (nothing if it is not stored, is on its
        way already, or both buffers are taken: one being read, one fetched and not popped)."""
        key, b = (layer, micro_batch), self._next
        if key not in self._out or b == self._reading or any(
                held == b for held, _, _ in self._back.values()):
            return
        stored, copied = self._out.pop(key)
        s = self.streams
        bufs = self._buffers[b]
        if [(t.shape, t.dtype) for t in bufs] != [(t.shape, t.dtype) for t in members(stored)]:
            bufs = self._buffers[b] = [torch.empty(t.shape, dtype=t.dtype, device=s.device)
                                       for t in members(stored)]
            self._freed[b] = s.event()  # new memory: the compute stream may have used it last
        with s.on(s.stash):
            s.wait(copied, s.stash)
            s.wait(self._freed[b], s.stash)
            s.stall("copy-back", s.stash)
            for buf, t in zip(bufs, members(stored)):
                buf.copy_(t, non_blocking=True)
            self._back[key] = (b, shaped_like(stored, bufs), s.event(s.stash))
        self._next = 1 - b

    def pop(self, layer: int, micro_batch: int):
        key = (layer, micro_batch)
        self._release()
        self.fetch(*key)
        if key not in self._back and key in self._out:
            raise RuntimeError(f"stash entry {key} popped while both device buffers hold "
                               "others: entries are read in the order they are fetched")
        b, x, landed = self._back.pop(key)
        self.streams.wait(landed)
        self._reading = b
        self._inflight.let_go()  # the forward's last copies out: not kept for the whole backward
        return x

    def _release(self) -> None:
        """The last popped entry is read no more (by work queued after now)."""
        if self._reading is not None:
            self._freed[self._reading] = self.streams.event()
            self._reading = None

    def clear(self) -> None:
        for _, _, landed in self._back.values():  # fetched, never read: the next step's copies
            self.streams.wait(landed)             # out into their host buffers come after
        self._release()
        self._back.clear()
        self._out.clear()
        self._inflight.clear()


class HostStash(_Staged):
    """CUDA: pinned host buffers, one per (layer, micro-batch, member), kept across steps."""

    def __init__(self, streams: Streams, micro_batches: int):
        super().__init__(streams, micro_batches)
        self._host: dict[tuple[int, int, int], torch.Tensor] = {}

    def put(self, layer: int, micro_batch: int, x):
        slots = []
        for j, t in enumerate(members(x)):
            host = self._host.get((layer, micro_batch, j))
            if host is None or host.shape != t.shape or host.dtype != t.dtype:
                host = self._host[layer, micro_batch, j] = self.streams.pinned(t.shape, t.dtype)
            slots.append(host)
        self._copy_out((layer, micro_batch), x, slots)
        return x


class EpsStash(_Staged):
    """Entries in an arena of EPS-owned shared memory, one per (block, micro-batch); the
    stashed layers are 1..``layers`` (the blocks). The arena is requested on the first put,
    sized for the whole depth from that first boundary (boundaries of a layered model all have
    one shape); each member of an entry starts at a multiple of 256 bytes. A larger boundary
    (padded text: a micro-batch of longer samples) gets a larger arena, each member the most
    it has needed; the entries already in the old one stay there until the step's end, when it
    is let go. On the CPU the forward goes on reading the arena copy; on CUDA it is staged as
    the host stash is."""

    def __init__(self, source, streams: Streams, layers: int, micro_batches: int):
        super().__init__(streams, micro_batches)
        self.source = source
        self.layers = layers
        self.micro_batches = micro_batches
        self.region = None
        self.entry_bytes = 0
        self._members: list[tuple[int, int]] = []  # (byte offset in the entry, room) each
        self._retired: list = []  # arenas outgrown this step: entries of it are still read

    def _arena(self, sizes: list[int]) -> None:
        """A new arena whose entries hold members of ``sizes`` bytes (rounded up to 256)."""
        offset, self._members = 0, []
        for nbytes in sizes:
            held = -(-nbytes // ENTRY_ALIGN) * ENTRY_ALIGN
            self._members.append((offset, held))
            offset += held
        self.entry_bytes = offset
        old = self.region
        self.region = self.source.stash_arena(self.entry_bytes * self.layers * self.micro_batches)
        if old is not None and self.region is not old:
            self._retired.append(old)

    def _slots(self, layer: int, micro_batch: int, x) -> list[torch.Tensor]:
        parts = members(x)
        sizes = [t.numel() * t.element_size() for t in parts]
        if self.region is None:
            self._arena(sizes)
        elif len(parts) != len(self._members):
            raise RuntimeError(f"stash entry of {len(parts)} tensors, the earlier ones had "
                               f"{len(self._members)}: boundaries of varying structure need "
                               "--stash device or host")
        elif any(n > held for n, (_, held) in zip(sizes, self._members)):
            self._arena([max(n, held) for n, (_, held) in zip(sizes, self._members)])
        base = ((layer - 1) * self.micro_batches + micro_batch) * self.entry_bytes
        return [self.region.tensor(t.dtype, (base + offset) // t.element_size(),
                                   t.numel()).view(t.shape)
                for t, (offset, _) in zip(parts, self._members)]

    def put(self, layer: int, micro_batch: int, x):
        slots = self._slots(layer, micro_batch, x)
        if self.streams.cuda:
            self._copy_out((layer, micro_batch), x, slots)
            return x
        for slot, t in zip(slots, members(x)):
            slot.copy_(t)
        stored = shaped_like(x, slots)
        self._out[layer, micro_batch] = (stored, None)
        return stored  # the forward reads the arena copy; the private x can go

    def fetch(self, layer: int, micro_batch: int) -> None:
        if self.streams.cuda:
            super().fetch(layer, micro_batch)

    def pop(self, layer: int, micro_batch: int):
        if self.streams.cuda:
            return super().pop(layer, micro_batch)
        return self._out.pop((layer, micro_batch))[0]

    def clear(self) -> None:
        super().clear()
        for region in self._retired:  # no entry of this step is left to read from them
            self.source.release_arena(region)
        self._retired.clear()


STASHES = ("device", "host", "eps")


def make_stash(kind: str, source, streams: Streams, layers: int, micro_batches: int):
    """``layers``: how many layers are stashed (the blocks, 1..layers)."""
    if kind == "device" or (kind == "host" and not streams.cuda):
        return DeviceStash()
    if kind == "host":
        return HostStash(streams, micro_batches)
    if kind == "eps":
        return EpsStash(source, streams, layers, micro_batches)
    raise ValueError(f"unknown stash placement {kind!r}; expected one of {STASHES}")
