"""The host and EPS stashes' CUDA bookkeeping, run on the CPU: streams that take the CUDA branches
but copy at once and log every event recorded and waited for. A whole training run through
them must equal the device stash bitwise; every entry must be fetched back ahead of the pop
that reads it; every wait must be for the right copy. (Whether the GPU honours the waits is
tests/test_cuda.py's part, with slowed streams.)"""

from __future__ import annotations

import contextlib
import itertools
import os

import pytest
import torch

import worker.executor
from protocol.shm import Region, unlink_prefix
from worker.config import ModelConfig
from worker.stash import DeviceStash, EpsStash, HostStash
from worker.streams import Streams

from .baseline import train_local_l2l


class Event:
    ids = itertools.count()

    def __init__(self, stream: str):
        self.stream, self.id = stream, next(self.ids)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class LoggedStreams(Streams):
    """The CUDA side of Streams on the CPU: copies are synchronous; events and waits logged."""

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.cuda = True
        self.h2d, self.d2h, self.stash = "h2d", "d2h", "stash"
        self.log: list[tuple] = []

    def event(self, stream=None, host_waits=False):
        ev = Event(stream or "compute")
        self.log.append(("record", ev.stream, ev))
        return ev

    def wait(self, event, stream=None):
        if event is not None:
            self.log.append(("wait", stream or "compute", event))

    def stall(self, point, stream=None):
        pass

    def on(self, stream):
        return contextlib.nullcontext()

    def pinned(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)


class Recorded:
    """A stash that logs the executor's calls to it."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def put(self, layer, i, x):
        self.calls.append(("put", layer, i))
        return self.inner.put(layer, i, x)

    def fetch(self, layer, i):
        self.calls.append(("fetch", layer, i))
        self.inner.fetch(layer, i)

    def pop(self, layer, i):
        self.calls.append(("pop", layer, i))
        x = self.inner.pop(layer, i)
        device = {t.data_ptr() for buffers in self.inner._buffers for t in buffers}
        assert all(t.data_ptr() in device for t in (x if isinstance(x, tuple) else (x,)))
        return x

    def clear(self):
        self.calls.append(("clear",))
        self.inner.clear()


class Arena:
    """A source's stash arena: a real shared-memory region, unlinked after the test."""

    def __init__(self):
        self.regions = []
        self.released = []

    def stash_arena(self, nbytes):
        if self.regions and self.regions[-1].nbytes == nbytes:  # as the EPS: the same one
            return self.regions[-1]
        name = f"l2l-test-stash-{os.getpid()}-{len(self.regions)}"
        unlink_prefix(name)
        self.regions.append(Region.create(name, nbytes))
        return self.regions[-1]

    def release_arena(self, region):
        assert region in self.regions and region is not self.regions[-1]  # never the live one
        self.released.append(region)
        region.unlink()
        region.close()

    def close(self):
        for r in self.regions:
            r.unlink()
            r.close()


CFG = ModelConfig(model="bert", layers=4, hidden=32, heads=2, seq_len=16, vocab=64, dropout=0.1)


def train_through(monkeypatch, cfg: ModelConfig, micro_batches: int, layer_drop: float, make,
                  during=contextlib.nullcontext, data=None, batch_size: int = 4) -> Arena:
    """Train ``cfg`` in-process twice, with the device stash and with the stash that
    ``make(arena, layers, micro_batches)`` returns (the run inside ``during()``): bitwise equal."""
    want = train_local_l2l(cfg, steps=3, micro_batches=micro_batches, batch_size=batch_size,
                           layer_drop=layer_drop, data=data)
    arena = Arena()
    monkeypatch.setattr(worker.executor, "make_stash",
                        lambda _kind, source, streams, layers, u: make(arena, layers, u))
    try:
        with during():
            got = train_local_l2l(cfg, steps=3, micro_batches=micro_batches,
                                  batch_size=batch_size, layer_drop=layer_drop, data=data)
    finally:
        arena.close()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    return arena


@pytest.mark.parametrize("cuda", [False, True])
def test_the_eps_stash_grows_with_longer_padded_micro_batches(monkeypatch, tmp_path, cuda):
    """Text padded per micro-batch: boundaries of varying length. An entry longer than the
    arena's gets a larger arena (entries of the old one are read from it until the step ends,
    then it is let go): training equals the device stash bitwise, on the CPU and through the
    CUDA bookkeeping."""
    pytest.importorskip("transformers")
    from worker.config import DataConfig

    from . import hf_fixtures as fx

    path = fx.model_dir(tmp_path / "model", "gpt2")
    # in file order, one text per micro-batch, one word (token) longer each: entries of 2..10
    # tokens (256 to 1280 bytes, in an arena of 256-byte rooms: some grow it, some fit)
    lm = fx.lengthening_jsonl(tmp_path / "lm.jsonl", 10)
    data = DataConfig(data=str(lm), shuffle=False)
    cfg = ModelConfig(model=f"hf:{path}", seq_len=16)

    def make(arena, layers, micro_batches):
        streams = LoggedStreams() if cuda else Streams(torch.device("cpu"))
        return EpsStash(arena, streams, layers, micro_batches)

    arena = train_through(monkeypatch, cfg, 3, 0.0, make, data=data, batch_size=1)
    assert len(arena.regions) == 5  # first at 2 tokens, grown at 3, 5, 7 and 9
    assert arena.released == arena.regions[:-1]  # every outgrown arena let go, once


@pytest.mark.parametrize("kind", ["host", "eps"])
@pytest.mark.parametrize("layer_drop", [0.0, 0.4])
def test_staged_stash_trains_bitwise_as_the_device_stash(monkeypatch, kind, layer_drop):
    made = []

    def make(arena, layers, micro_batches):
        s = LoggedStreams()
        made.append(Recorded(HostStash(s, micro_batches) if kind == "host" else
                             EpsStash(arena, s, layers, micro_batches)))
        return made[-1]

    train_through(monkeypatch, CFG, 3, layer_drop, make)
    [stash] = made
    pops = [c for c in stash.calls if c[0] == "pop"]
    assert pops  # the blocks' inputs were stashed and read back
    for n, call in enumerate(stash.calls):
        if call[0] == "pop":  # fetched earlier, while an earlier input computed
            earlier = stash.calls[:n]
            since = earlier[len(earlier) - earlier[::-1].index(("clear",)):] \
                if ("clear",) in earlier else earlier
            assert ("fetch", *call[1:]) in since, (call, stash.calls)
    check_waits(stash.inner.streams.log)


def check_waits(log):
    """Each copy back waits (on the stash stream) for its copy out, recorded on d2h, and for
    its device buffer's release, recorded on the compute stream; the compute stream waits for
    each copy back, recorded on the stash stream, before it reads it."""
    waits = [(stream, ev) for op, stream, ev in log if op == "wait"]
    assert {(stream, ev.stream) for stream, ev in waits} == {
        ("d2h", "compute"), ("stash", "d2h"), ("stash", "compute"), ("compute", "stash")}
    out = [ev for stream, ev in waits if stream == "stash" and ev.stream == "d2h"]
    assert len(out) == len(set(out))  # each copy out is brought back once
    freed = [ev for stream, ev in waits if stream == "stash" and ev.stream == "compute"]
    assert len(freed) == len(out)  # and each into a buffer the compute stream let go of
    landed = [ev for stream, ev in waits if stream == "compute" and ev.stream == "stash"]
    assert len(landed) == len(out)


def test_an_entry_fetched_but_never_read_is_waited_for_before_its_buffer_is_reused():
    s = LoggedStreams()
    stash = HostStash(s, 3)
    x = (torch.randn(4, 8), torch.arange(6))
    assert stash.put(1, 0, x) is x
    stash.fetch(1, 0)
    stash.fetch(1, 0)  # once on its way, not again
    stash.fetch(2, 0)  # not stored: nothing
    landed = s.log[-1][2]
    assert s.log[-1][:2] == ("record", "stash")
    stash.clear()
    assert s.log[-1] == ("wait", "compute", landed)
    with pytest.raises(KeyError):
        stash.pop(1, 0)


def test_a_popped_entry_is_a_device_copy_with_the_boundary_structure():
    s = LoggedStreams()
    stash = HostStash(s, 3)
    x = (torch.randn(4, 8), torch.arange(6))
    want = tuple(t.clone() for t in x)
    stash.put(3, 1, x)
    x[0].add_(1)  # the caller's tensor may change after the copy out: the stash keeps its own
    got = stash.pop(3, 1)
    assert isinstance(got, tuple) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert s.log[-1][:2] == ("wait", "compute")
    single = torch.randn(5)
    stash.put(3, 1, single)
    assert torch.equal(stash.pop(3, 1), single)
    device = DeviceStash()
    device.fetch(1, 0)  # nothing to do, nothing to fail


def test_two_device_buffers_in_turn_each_refilled_after_its_entry_was_read():
    s = LoggedStreams()
    stash = HostStash(s, 3)
    xs = [torch.full((4, 8), float(i)) for i in range(3)]
    for i, x in enumerate(xs):
        stash.put(1, i, x)
    first = stash.pop(1, 0)
    stash.fetch(1, 1)
    mark = len(s.log)
    second = stash.pop(1, 1)  # entry 0 is read no more: its buffer is released here
    [released] = [ev for op, stream, ev in s.log[mark:] if op == "record" and stream == "compute"]
    mark = len(s.log)
    stash.fetch(1, 2)  # into entry 0's buffer, once the compute stream is past its reads
    assert ("wait", "stash", released) in s.log[mark:]
    third = stash.pop(1, 2)
    assert third.data_ptr() == first.data_ptr() != second.data_ptr()  # two entries on the device
    assert torch.equal(third, xs[2]) and torch.equal(second, xs[1])
    stash.clear()


def test_entries_read_out_of_their_fetch_order_are_refused():
    stash = HostStash(LoggedStreams(), 3)
    for i in range(3):
        stash.put(2, i, torch.randn(3))
    stash.fetch(2, 0)
    stash.fetch(2, 1)
    stash.fetch(2, 2)  # both buffers hold unread entries: not now
    with pytest.raises(RuntimeError, match="in the order they are fetched"):
        stash.pop(2, 2)
    stash.pop(2, 0)
    stash.pop(2, 1)
    stash.pop(2, 2)  # fetched at its pop


def test_copies_out_left_pending_are_bounded():
    """A host running ahead of the GPU waits for the oldest copy out beyond two layers' worth
    (2 x micro-batches), so pending entries cannot pile up with depth; sources of finished
    copies are let go at each pop, not kept through the backward."""

    class Pending(Event):
        def __init__(self):
            super().__init__("d2h")
            self.waited = False

        def query(self):
            return self.waited

        def synchronize(self):
            self.waited = True

    s = LoggedStreams()
    s.event = lambda stream=None, host_waits=False: Pending()
    stash = HostStash(s, micro_batches=2)
    added, add = [], stash._inflight.add
    stash._inflight.add = lambda ev, tensors: (added.append(ev), add(ev, tensors))
    for layer in range(1, 6):
        for i in range(2):
            stash.put(layer, i, torch.randn(3))
    assert [ev.waited for ev in added] == [True] * 6 + [False] * 4
    for ev in added[6:8]:
        ev.waited = True  # two copies finished meanwhile: the next pop lets their sources go
    stash.pop(5, 0)
    assert len(stash._inflight._q) == 2
    stash.clear()
    assert all(ev.waited for ev in added)


def test_every_stream_can_be_slowed_for_the_cuda_tests():
    from worker.faults import CYCLES_PER_US, parse_delays

    assert parse_delays("copy:1,compute:2,d2h:3,copy-back:4") == {
        p: us * CYCLES_PER_US for p, us in (("copy", 1), ("compute", 2), ("d2h", 3),
                                             ("copy-back", 4))}
    for bad in ("stash:5", "copy-back", "copy-back:-1"):
        with pytest.raises(ValueError, match="POINT:MICROSECONDS"):
            parse_delays(bad)
