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
from protocol.messages import GradAck, LayerReady
from worker.config import ModelConfig
from worker.grads import DeviceGrads, ToFrame, ToSlot
from worker.regions import SlotRing, frombuffer
from worker.source import EpsSource
from worker.weights import DeviceCopyWeights, FetchLocator

from .baseline import train_local_l2l
from .happens_before import HOST, ClockedStreams, HappensBefore, Ops

SLOTS = 2


class ThreadEps:
    """The EPS side of EpsClient (fetch, push_grad, wait) as one thread serving a queue: what
    reaches it carries the sender's clock, its answers carry its own. With ``shared`` slots
    (shm) it also serves the weights in place, as regions: the worker copies them to the device
    from where the EPS updates them (``get``/``tensor``: worker.regions.Regions' part)."""

    def __init__(self, hb: HappensBefore, model, layout, opt, shared=None):
        self.hb, self.layout, self.lr, self.shared = hb, layout, opt.lr, shared
        self.served = torch.cat([model.init_flat(p.index, p) for p in layout.layers])
        self.offsets = [sum(q.numel for q in layout.layers[:p.index]) for p in layout.layers]
        self.flats = [self.tensor(torch.float32, o, p.numel)
                      for o, p in zip(self.offsets, layout.layers)]
        self.grads = [torch.zeros(p.numel) for p in layout.layers]
        self.opts = [make_optimizer(p, f, g, None, opt) for p, f, g in
                     zip(layout.layers, self.flats, self.grads)]
        self.versions = [0] * len(layout.layers)
        self.asked: list[tuple[int, int, Future]] = []  # fetches of versions to come
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

    def get(self, region: str):
        return self

    def tensor(self, dtype: torch.dtype, offset: int, numel: int) -> torch.Tensor:
        return self.served[offset:offset + numel]

    def close(self) -> None:
        self.inbox.put(None)
        self.thread.join(60)

    def _send(self, handler, *args) -> Future:
        fut: Future = Future()
        self.inbox.put((self.hb.send(), handler, args, fut))
        return fut

    def _serve(self) -> None:
        while (item := self.inbox.get()) is not None:
            clock, handler, args, fut = item
            self.hb.receive(clock)
            try:
                handler(*args, fut)
            except BaseException as e:  # the worker's wait raises it
                fut.set_exception(e)

    def _answer(self, fut: Future, result) -> None:
        fut.clock = self.hb.send()
        fut.set_result(result)

    def _fetch(self, layer: int, version: int, fut: Future) -> None:
        if self.versions[layer] < version:
            self.asked.append((layer, version, fut))  # answered once the update is in
            return
        flat, shm = self.flats[layer], self.shared is not None
        ready = LayerReady(req_id=0, layer=layer, version=self.versions[layer],
                           region="served" if shm else "", offset=self.offsets[layer] * 4,
                           nbytes=flat.numel() * 4, dtype="float32")
        self._answer(fut, (ready, [] if shm else [flat.numpy().tobytes()]))

    def _push(self, step: int, layer: int, slot: int, data, skip: bool, fut: Future) -> None:
        if not skip:
            plan = self.layout.layers[layer]
            got = (frombuffer(data, torch.float32) if data is not None
                   else self.shared.slot(slot, plan))
            with self.hb.on(HOST):
                self.hb.op([(got, False)], "the EPS reads the gradient")
            self.grads[layer].copy_(got[:plan.numel])
            self.opts[layer].step(step, lr=self.lr)
            with self.hb.on(HOST):
                self.hb.op([(self.flats[layer], True)], "the EPS updates the layer")
        self.versions[layer] = step + 1
        self._answer(fut, (GradAck(req_id=0, step=step, layer=layer, slot=slot), []))
        asked, self.asked = self.asked, []
        for layer_, version, waiting in asked:
            self._fetch(layer_, version, waiting)


class SharedSlots:
    """The rank's gradient slots (shm transport), as worker.regions.GradSlots hands them out."""

    def __init__(self, layout):
        self.stride = layout.max_layer_numel
        self.data = torch.zeros(SLOTS * self.stride)

    def slot(self, slot: int, plan) -> torch.Tensor:
        return self.data[slot * self.stride:slot * self.stride + plan.numel]


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
          dropped=None) -> list:
    hb = HappensBefore(dropped)
    monkeypatch.setattr(worker.weights, "Streams", lambda device, delays=None: ClockedStreams(hb))
    monkeypatch.setattr(worker.grads, "Streams", lambda device, delays=None: ClockedStreams(hb))
    monkeypatch.setattr(worker.grads, "SlotRing", clocked_slot_ring(hb))
    made = []

    def source(model_, layout, opt):
        shared = SharedSlots(layout) if transport == "shm" else None
        eps = ThreadEps(hb, model_, layout, opt, shared)
        cpu = torch.device("cpu")
        weights = DeviceCopyWeights(FetchLocator(eps), eps, eps, layout, device=cpu,
                                    compute_dtype="float32")
        if shared is not None:
            out = ToSlot(shared, non_blocking=True)
            for s in range(SLOTS):
                hb.watch(shared.data[s * shared.stride:(s + 1) * shared.stride],
                         f"shared slot {s}")
        else:
            out = ToFrame([torch.empty(layout.max_layer_numel) for _ in range(SLOTS)], True)
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
                      dropout=0.1)
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
    assert {"compute", "h2d", "d2h", f"{HOST} eps"} <= hb.seen(), hb.seen()
    return hb.races


@pytest.mark.parametrize("transport,model,micro_batches,layer_drop", [
    ("frames", "bert", 3, 0.0), ("shm", "gpt", 2, 0.4), ("frames", "gpt", 1, 0.4)])
def test_no_copy_touches_a_weight_or_gradient_buffer_out_of_order(monkeypatch, transport, model,
                                                                   micro_batches, layer_drop):
    found = races(monkeypatch, transport, model, micro_batches, layer_drop)
    assert not found, found[:5]


@pytest.mark.parametrize("dropped,buffers", [
    (("h2d", "compute"), {"weight buffer"}),
    # the copy's read of the EPS's region comes before the EPS's update of it through the
    # chain landed -> the layer's backward -> computed -> pushed
    (("compute", "h2d"), {"weight buffer", "served layer"}),
    (("d2h", "compute"), {"gradient accumulator", "served layer"}),
    ((HOST, "d2h"), {"gradient accumulator", "shared slot", "served layer"})],
    ids=["released", "landed", "computed", "pushed"])
def test_each_wait_is_needed(monkeypatch, dropped, buffers):
    """Without any one kind of wait the check finds races on the buffers it guards: it would
    see a missing one."""
    found = races(monkeypatch, "shm", "bert", 3, 0.0, dropped)
    assert {name.rstrip(" 0123456789") for name, *_ in found} == buffers, found[:5]
