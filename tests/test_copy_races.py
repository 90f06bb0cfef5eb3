"""A happens-before check (happens_before.py) of the worker's CUDA copy paths, on the CPU: the
weights' side-stream prefetch into two device buffers (weights.DeviceCopyWeights: copier
thread, h2d stream, released/landed events) and the gradients' device-to-host push
(grads.DeviceGrads: pusher thread, d2h stream, the compute stream's event, a host
synchronization before the EPS is told). The EPS is a thread of this process: a Fetch is
answered once its version exists, each push is read and applied by the EPS's per-layer AdamW,
the slot given back with the ack. Over frames, weights come as copies and gradients from
staging slots; over shm, weights are copied from where the EPS updates them and gradients go
to its shared slots. Training must equal the local loop bitwise; every access to a device
weight buffer, gradient accumulator, host slot or served layer by a stream or the EPS must be
ordered; dropping any one kind of wait must show races on what it guards."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

import pytest
import torch

import worker.grads
import worker.weights
from eps_server.optimizers import make_optimizer
from protocol.messages import GradAck, LayerReady, RegionInfo
from worker.config import ModelConfig
from worker.grads import DeviceGrads, ToFrame, ToSlot
from worker.regions import SlotRing, frombuffer
from worker.source import EpsSource
from worker.weights import BoardLocator, DeviceCopyWeights, FetchLocator

from .baseline import train_local_l2l
from .happens_before import HOST, ClockedStreams, HappensBefore, Ops, joined

SLOTS = 2


class Reply(Future):
    """An EPS answer: whoever sees it done (a waiter, a callback) learns the clock of the work
    it answers for, and no more (the EPS's other messages are not behind it by design)."""

    def __init__(self, hb: HappensBefore):
        super().__init__()
        self.hb, self.clock = hb, None

    def add_done_callback(self, fn) -> None:
        super().add_done_callback(lambda f: self._in_the_know(fn, f))

    def _in_the_know(self, fn, f) -> None:
        with self.hb.knowing(self.clock):
            fn(f)


class ThreadEps:
    """The EPS side of EpsClient (fetch, push_grad, wait) as one thread serving a queue. Each
    message is handled as an agent of its own, knowing what its sender knew and what made the
    version it reads or replaces; its reply carries that. With ``shared`` slots (shm) the
    weights are served in place (``get``/``tensor``: worker.regions.Regions' part) and their
    versions on a board (``eps[layer]``: the version read and what made it learned)."""

    def __init__(self, hb: HappensBefore, model, layout, opt, shared=None):
        self.hb, self.layout, self.lr, self.shared = hb, layout, opt.lr, shared
        self.served = torch.zeros(layout.total_numel)
        self.flats = [self.tensor(torch.float32, p.offset, p.numel) for p in layout.layers]
        for p, flat in zip(layout.layers, self.flats):
            flat.copy_(model.init_flat(p.index, p))
        self.grads = [torch.zeros(p.numel) for p in layout.layers]
        self.opts = [make_optimizer(p, f, None, opt) for p, f in
                     zip(layout.layers, self.flats)]
        self.versions = [0] * len(layout.layers)
        self.made: list[dict] = [{} for _ in layout.layers]  # clock of each layer's version
        self.asked: list[tuple[int, int, dict, Reply]] = []  # fetches of versions to come
        self.messages = 0
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="eps", daemon=True)
        self.thread.start()

    # EpsClient, as the worker's threads call it
    def fetch(self, layer: int, min_version: int, which: str = "compute") -> Future:
        return self._send(self._fetch, layer, min_version)

    def push_grad(self, *, step, layer, rank, slot, dtype, data=None, skip=False) -> Future:
        return self._send(self._push, step, layer, slot, data, skip)

    def wait(self, fut: Future, timeout: float | None = None):
        result = fut.result(timeout or 60)
        self.hb.receive(getattr(fut, "clock", None))
        return result

    def tick(self) -> None:
        pass

    def close(self) -> None:
        self.inbox.put(None)
        self.thread.join(60)

    # the worker's Regions and version board
    def get(self, region: str):
        return self

    def tensor(self, dtype: torch.dtype, offset: int, numel: int) -> torch.Tensor:
        return self.served[offset:offset + numel]

    def __getitem__(self, layer: int) -> int:
        version, made = self.versions[layer], self.made[layer]  # the EPS writes made first
        self.hb.receive(made)
        return version

    def _send(self, handler, *args) -> Future:
        fut = Reply(self.hb)
        self.inbox.put((self.hb.send(), handler, args, fut))
        return fut

    def _serve(self) -> None:
        while (item := self.inbox.get()) is not None:
            clock, handler, args, fut = item
            self.messages += 1
            try:
                handler(*args, f"eps #{self.messages}", clock, fut)
            except BaseException as e:  # the worker's wait raises it
                fut.set_exception(e)

    def _fetch(self, layer: int, version: int, me: str, clock: dict, fut: Reply) -> None:
        if self.versions[layer] < version:
            self.asked.append((layer, version, clock, fut))  # answered once the update is in
            return
        flat, shm = self.flats[layer], self.shared is not None
        ready = LayerReady(req_id=0, layer=layer, version=self.versions[layer],
                           region="served" if shm else "",
                           offset=self.layout.layers[layer].byte_offset("float32"),
                           nbytes=flat.numel() * 4, dtype="float32")
        fut.clock = joined(clock, self.made[layer])
        fut.set_result((ready, [] if shm else [flat.numpy().tobytes()]))

    def _push(self, step, layer, slot, data, skip, me: str, clock: dict, fut: Reply) -> None:
        clock = joined(clock, self.made[layer])
        if not skip:
            plan = self.layout.layers[layer]
            got = (frombuffer(data, torch.float32) if data is not None
                   else self.shared.slot(slot, plan))
            self.hb.op_as(me, clock, [(got, False)], "the EPS reads the gradient")
            self.grads[layer][:plan.trainable].copy_(got[:plan.trainable])
            self.opts[layer].step((self.grads[layer],), step, lr=self.lr)
            self.hb.op_as(me, clock, [(self.flats[layer], True)], "the EPS updates the layer")
        self.made[layer] = dict(clock)
        self.versions[layer] = step + 1
        fut.clock = dict(clock)
        fut.set_result((GradAck(req_id=0, step=step, layer=layer, slot=slot), []))
        asked, self.asked = self.asked, []
        for layer_, version, asker, waiting in asked:
            self._fetch(layer_, version, me, asker, waiting)


class SharedSlots:
    """The rank's gradient slots (shm transport), as worker.regions.GradSlots hands them out."""

    def __init__(self, layout):
        self.stride = layout.max_trainable_numel
        self.data = torch.zeros(SLOTS * self.stride)

    def slot(self, slot: int, plan) -> torch.Tensor:
        return self.data[slot * self.stride:slot * self.stride + plan.trainable]


def clocked_slot_ring(hb: HappensBefore):
    class ClockedSlotRing(SlotRing):
        """A slot given back passes on what the thread giving it back knew."""

        def __init__(self, slots: int):
            super().__init__(slots)
            self.clocks: dict[int, dict] = {}

        def acquire(self, timeout: float) -> int:
            slot = super().acquire(timeout)
            hb.receive(self.clocks.pop(slot, None))
            return slot

        def release(self, slot: int) -> None:
            self.clocks[slot] = hb.send()
            super().release(slot)

    return ClockedSlotRing


class _Source(EpsSource):
    """EpsSource over the thread EPS, with its final weights where the local source has them."""

    def __init__(self, eps: ThreadEps, weights, grads):
        super().__init__(eps, None, weights, grads)
        self.flats = eps.flats


def races(monkeypatch, transport: str, model: str, micro_batches: int, layer_drop: float,
          dropped=None, freeze: str = "") -> list:
    hb = HappensBefore(dropped)
    monkeypatch.setattr(worker.weights, "Streams", lambda device, delays=None: ClockedStreams(hb))
    monkeypatch.setattr(worker.grads, "Streams", lambda device, delays=None: ClockedStreams(hb))
    monkeypatch.setattr(worker.grads, "SlotRing", clocked_slot_ring(hb))
    made, located = [], []

    def source(model_, layout, opt):
        shared = SharedSlots(layout) if transport == "shm" else None
        eps = ThreadEps(hb, model_, layout, opt, shared)
        cpu = torch.device("cpu")
        locator = FetchLocator(eps) if shared is None else BoardLocator(
            eps, eps, RegionInfo(name="served", nbytes=layout.total_numel * 4,
                                       dtype="float32"), layout)
        weights = DeviceCopyWeights(locator, eps, eps, layout, device=cpu,
                                    compute_dtype="float32")
        located.append(locator)
        if shared is not None:
            out = ToSlot(shared, non_blocking=True)
            for s in range(SLOTS):
                hb.watch(shared.data[s * shared.stride:(s + 1) * shared.stride],
                         f"shared slot {s}")
        else:
            out = ToFrame([torch.empty(layout.max_trainable_numel) for _ in range(SLOTS)], True)
            for s, t in enumerate(out.staging):
                hb.watch(t, f"staging slot {s}")
        grads = DeviceGrads(eps, layout, device=cpu, out=out, rank=0, dtype="float32",
                            slots=SLOTS, timeout=60)
        for b, t in enumerate(weights.buffers):
            hb.watch(t, f"weight buffer {b}")
        for plan, flat in zip(layout.layers, eps.flats):
            hb.watch(flat, f"served layer {plan.index}")
        for s, t in enumerate(grads.local):
            hb.watch(t, f"gradient accumulator {s}")
        made.append((eps, weights, grads))
        return _Source(eps, weights, grads)

    cfg = ModelConfig(model=model, layers=4, hidden=32, heads=2, seq_len=16, vocab=64,
                      dropout=0.1, freeze=freeze)
    want = train_local_l2l(cfg, steps=3, micro_batches=micro_batches, batch_size=4,
                           layer_drop=layer_drop)
    try:
        with Ops(hb):
            got = train_local_l2l(cfg, steps=3, micro_batches=micro_batches, batch_size=4,
                                  layer_drop=layer_drop, source=source)
    finally:
        for eps, weights, grads in made:
            weights.close()
            grads.close()
            eps.close()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    agents = hb.seen()
    assert {"compute", "h2d", "d2h"} <= agents and any(a.startswith("eps #") for a in agents)
    if transport == "shm":  # most weights located on the board, without a Fetch
        assert located[0].fast_fetches > 10, located[0].fast_fetches
    return hb.races


@pytest.mark.parametrize("transport,model,micro_batches,layer_drop,freeze", [
    ("frames", "bert", 3, 0.0, ""), ("shm", "gpt", 2, 0.4, ""), ("frames", "gpt", 1, 0.4, ""),
    ("shm", "gpt", 2, 0.0, "blocks.*.mlp*"), ("frames", "gpt", 2, 0.0, "blocks.*.mlp*")])
def test_no_copy_touches_a_weight_or_gradient_buffer_out_of_order(monkeypatch, transport, model,
                                                                   micro_batches, layer_drop,
                                                                   freeze):
    """(With the blocks' MLPs frozen a gradient slot holds less than a block: the largest
    trained part.)"""
    found = races(monkeypatch, transport, model, micro_batches, layer_drop, freeze=freeze)
    assert not found, found[:5]


@pytest.mark.parametrize("transport", ["shm", "frames"])
@pytest.mark.parametrize("dropped,buffers", [
    (("h2d", "compute"), {"weight buffer"}),
    # over shm, the copy's read of the EPS's region comes before the EPS's update of it
    # through the chain landed -> the layer's backward -> computed -> pushed
    (("compute", "h2d"), {"weight buffer", "served layer"}),
    (("d2h", "compute"), {"gradient accumulator", "served layer"}),
    ((HOST, "d2h"), {"gradient accumulator", "shared slot", "served layer"})],
    ids=["released", "landed", "computed", "pushed"])
def test_each_wait_is_needed(monkeypatch, transport, dropped, buffers):
    """Without any one kind of wait the check finds races on the buffers it guards: it would
    see a missing one."""
    if transport == "frames":  # weights come as copies, gradients go from staging slots
        buffers = {"staging slot" if b == "shared slot" else b for b in buffers} - {
            "served layer"}
    found = races(monkeypatch, transport, "bert", 3, 0.0, dropped)
    assert {name.rstrip(" 0123456789") for name, *_ in found} == buffers, found[:5]
