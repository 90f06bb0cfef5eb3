"""A happens-before check of the stash's CUDA stream discipline, on the CPU. Training runs through
the host and EPS stashes' CUDA branches with fake streams: every aten op is attributed to the
stream current when it runs; each stream has a vector clock, an event carries its stream's
clock when recorded, a wait merges it into the waiting stream's. Two accesses to a stash buffer
(pinned host slot, EPS arena entry, device copy-back buffer) from different streams, one of
them a write, must be ordered, or it is a race the GPU could lose. Dropping any one kind of
wait must show races, so the check itself is shown to see them."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from worker.config import ModelConfig
from worker.stash import EpsStash, HostStash

from . import test_stash

STREAMS = ("compute", "d2h", "stash")


def span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


class HappensBefore:
    def __init__(self, dropped: tuple[str, str] | None = None):
        self.current = "compute"
        self.clock = {s: dict.fromkeys(STREAMS, 0) for s in STREAMS}
        self.buffers: list[tuple[int, int, str]] = []  # (start, end, name)
        self.accesses: dict[int, list] = {}  # buffer -> [(stream, clock, write, op)]
        self.races: list[tuple] = []
        self.dropped = dropped  # (waiting stream, event's stream): such waits are skipped

    def watch(self, t: torch.Tensor, name: str) -> None:
        if (*span(t), name) not in self.buffers:
            self.buffers.append((*span(t), name))

    def tick(self) -> None:
        self.clock[self.current][self.current] += 1

    def touch(self, t, write: bool, op: str) -> None:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return
        lo, hi = span(t)
        me, now = self.current, dict(self.clock[self.current])
        for k, (a, b, name) in enumerate(self.buffers):
            if lo < b and a < hi:
                for other, then, wrote, what in self.accesses.setdefault(k, []):
                    if other != me and (wrote or write) and now[other] < then[other]:
                        self.races.append((name, other, what, me, op))
                self.accesses[k].append((me, now, write, op))


class Event(test_stash.Event):
    def __init__(self, hb: HappensBefore, stream: str):
        super().__init__(stream)
        self.clock = dict(hb.clock[stream])


class ClockedStreams(test_stash.LoggedStreams):
    """Events carry clocks, waits merge them; work runs on the stream ``on`` names."""

    def __init__(self, hb: HappensBefore):
        super().__init__()
        self.hb = hb

    def event(self, stream=None, host_waits=False):
        return Event(self.hb, stream or "compute")

    def wait(self, event, stream=None):
        me = stream or "compute"
        if event is None or (me, event.stream) == self.hb.dropped:
            return
        for s in STREAMS:
            self.hb.clock[me][s] = max(self.hb.clock[me][s], event.clock[s])

    @contextlib.contextmanager
    def on(self, stream):
        before, self.hb.current = self.hb.current, stream
        try:
            yield
        finally:
            self.hb.current = before

    def pinned(self, shape, dtype):
        t = torch.empty(shape, dtype=dtype)
        self.hb.watch(t, "host slot")
        return t


class Ops(TorchDispatchMode):
    """Each aten op: a tick of the current stream, then its tensor arguments touched (written
    where the schema says the op writes them)."""

    def __init__(self, hb: HappensBefore):
        super().__init__()
        self.hb = hb

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.hb.tick()
        if not func.is_view:
            schema = func._schema.arguments
            given = list(args) + [kwargs.get(a.name) for a in schema[len(args):]]
            for arg, value in zip(schema, given):
                write = arg.alias_info is not None and arg.alias_info.is_write
                for t in value if isinstance(value, (list, tuple)) else [value]:
                    self.hb.touch(t, write, str(func))
        return func(*args, **kwargs)


def watched(stash, hb: HappensBefore):
    """The stash, its device buffers and arena entries watched as they are made."""
    fetch, slots = stash.fetch, getattr(stash, "_slots", None)

    def watching_fetch(layer, i):
        fetch(layer, i)
        for j, buffers in enumerate(stash._buffers):
            for t in buffers:
                hb.watch(t, f"device buffer {j}")

    def watching_slots(layer, i, x):
        out = slots(layer, i, x)
        for t in out:
            hb.watch(t, f"arena entry {layer},{i}")
        return out

    stash.fetch = watching_fetch
    if slots is not None:
        stash._slots = watching_slots
    return stash


def races(monkeypatch, kind: str, model: str, micro_batches: int, layer_drop: float,
          dropped=None) -> list:
    hb = HappensBefore(dropped)

    def make(arena, layers, u):
        s = ClockedStreams(hb)
        return watched(HostStash(s, u) if kind == "host" else EpsStash(arena, s, layers, u), hb)

    cfg = ModelConfig(model=model, layers=5, hidden=32, heads=2, seq_len=16, vocab=64,
                      dropout=0.1)
    test_stash.train_through(monkeypatch, cfg, micro_batches, layer_drop, make, lambda: Ops(hb))
    seen = {stream for accesses in hb.accesses.values() for stream, *_ in accesses}
    assert seen == set(STREAMS)  # each stream was watched touching the stash's buffers
    return hb.races


@pytest.mark.parametrize("kind,model,micro_batches,layer_drop", [
    ("host", "bert", 3, 0.0), ("eps", "gpt", 2, 0.4), ("host", "gpt", 1, 0.4)])
def test_no_stream_touches_a_stash_buffer_out_of_order(monkeypatch, kind, model, micro_batches,
                                                       layer_drop):
    found = races(monkeypatch, kind, model, micro_batches, layer_drop)
    assert not found, found[:5]


@pytest.mark.parametrize("dropped", [("d2h", "compute"), ("stash", "d2h"),
                                     ("stash", "compute"), ("compute", "stash")],
                         ids=["produced", "copied", "freed", "landed"])
def test_each_wait_is_needed(monkeypatch, dropped):
    """Without any one kind of wait the check finds races: it would see a missing one."""
    assert races(monkeypatch, "host", "bert", 3, 0.0, dropped)
