"""A happens-before check of the stash's CUDA stream discipline, on the CPU (happens_before.py):
training runs through the host and EPS stashes' CUDA branches with fake streams. Two accesses
to a stash buffer (pinned host slot, EPS arena entry, device copy-back buffer) from different
streams, one of them a write, must be ordered, or it is a race the GPU could lose. Dropping any
one kind of wait must show races, so the check itself is shown to see them."""

from __future__ import annotations

import pytest

from worker.config import ModelConfig
from worker.stash import EpsStash, HostStash

from . import test_stash
from .happens_before import ClockedStreams, HappensBefore, Ops

STREAMS = {"compute", "d2h", "stash"}


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
    assert hb.seen() == STREAMS  # each stream was watched touching the stash's buffers
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
