"""Where a worker's layers come from and its gradients go: the EPS (``EpsSource``).

The executor talks to a *layer source* with five calls, so the same L2L loop runs against the
EPS or, for baselines, against weights held in-process (``bench/local.py``):

    prefetch(layer, version)   start getting the weights of a later visit
    weights(layer, version)    the layer's flat weights, ready on the compute device
    release(layer, version)    the visit is done reading them (their buffer may be refilled)
    grad_buffer(plan)          (slot, flat buffer) to accumulate the layer's gradient into
    push(step, plan, slot, buf), drain()   send it (asynchronously); wait for the step's acks

EpsSource overlaps everything it can with compute:
- a layer whose version the EPS has already published (its shared version board says so) is
  read without asking; otherwise a Fetch is in flight one visit ahead; on CPU the layer is then
  read in place from shared memory (no copy), on CUDA a copier thread lands it in one of two
  device buffers on a side stream, behind that buffer's *released* event, and the compute
  stream waits on its *ready* event;
- gradients are accumulated straight into the shared slot (CPU) or into a device buffer that a
  pusher thread copies into the pinned shared slot on a side stream before sending the push;
- a slot comes back when the EPS acks the push (it has been reduced); the EPS updates the layer
  while the worker computes the next one.
"""

from __future__ import annotations

import platform
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from protocol.messages import LayerReady, StashArena
from protocol.shm import Region
from protocol.tensors import DTYPES, LayerPlan, Layout
from protocol.trace import NULL, Tracer

from .eps_client import EpsClient
from .streams import Streams
from .transfer import GradSlots, Regions, SlotRing, layer_view, padding_gaps

STORE_ORDERED = ("x86_64", "AMD64", "i686", "i386")  # CPUs whose stores are seen in order


class EpsSource:
    def __init__(self, client: EpsClient, welcome, layout: Layout, *, rank: int,
                 device: torch.device, transport: str, timeout: float,
                 tracer: Tracer = NULL, copy_weights: bool = False, overlap: bool = True):
        self.client = client
        self.overlap = overlap
        self.rank = rank
        self.layout = layout
        self.device = device
        self.transport = transport
        self.timeout = timeout
        self.tracer = tracer
        self.streams = Streams(device)
        self.grad_dtype_name = welcome.grad_dtype
        self.grad_dtype = DTYPES[welcome.grad_dtype]
        cuda = device.type == "cuda"
        # CPU: read weights in place (no copy) unless asked to copy (exercises the copy path).
        self.in_place = not cuda and not copy_weights
        self.regions = Regions(pin=cuda)
        if transport == "shm":
            for info in (welcome.master, welcome.compute):
                if info is not None:
                    self.regions.attach(info, writable=False)
        # The EPS's version board: a layer whose version is already there is read without a
        # round trip. Not with fp16 (each step's loss scale comes with its Fetch replies), nor
        # on CPUs that may reorder stores (the board relies on x86's ordering).
        self.board = None
        self.served = welcome.compute or welcome.master
        if (transport == "shm" and welcome.versions is not None
                and welcome.compute_dtype != "float16" and platform.machine() in STORE_ORDERED):
            self.board = self.regions.attach(welcome.versions, writable=False).tensor(torch.int64)
        self.fast_fetches = 0
        n = layout.max_layer_numel
        compute = DTYPES[welcome.compute_dtype]
        self.buffers = [] if self.in_place else [
            torch.empty(n, dtype=compute, device=device) for _ in range(2)]
        self._released: list = [None, None]  # per buffer: event after its last reader
        self._free_buffers = [0, 1]
        self._copier = None if self.in_place else ThreadPoolExecutor(1, "l2l-prefetch")
        self.slots = SlotRing(welcome.grad_slots)
        self.shared = (GradSlots(self.regions, welcome, layout, self.grad_dtype)
                       if transport == "shm" else None)
        # Micro-batch sums accumulate in fp32 whatever the wire dtype: straight into the shared
        # slot on CPU when that is fp32, else in local buffers converted at push time.
        acc = torch.float32
        self.in_slot = self.shared is not None and not cuda and self.grad_dtype == acc
        self.local = [] if self.in_slot else [
            torch.empty(n, dtype=acc, device=device) for _ in range(welcome.grad_slots)]
        self.staging = ([torch.empty(n, dtype=self.grad_dtype, pin_memory=cuda)
                         for _ in range(welcome.grad_slots)]
                        if self.shared is None and (cuda or self.grad_dtype != acc) else [])
        self._scales: dict[int, float] = {}
        self._pusher = ThreadPoolExecutor(1, "l2l-push") if cuda else None
        self._pending: dict[tuple[int, int], Future] = {}
        self._held: dict[tuple[int, int], object] = {}
        self._pushes: list[Future] = []
        self._gaps = {p.index: padding_gaps(p) for p in layout.layers}

    # ------------------------------------------------------------------------- weights

    def prefetch(self, layer: int, version: int) -> None:
        if not self.overlap:
            return  # the non-overlapped path: weights() asks when it needs them
        self._request(layer, version)

    def _request(self, layer: int, version: int) -> None:
        key = (layer, version)
        if key in self._pending:
            return
        if self.board is not None and int(self.board[layer]) >= version:
            reply = Future()  # the version is there: no need to ask the EPS
            reply.set_result((self._local_ready(layer), []))
            self.fast_fetches += 1
        else:
            reply = self.client.fetch(layer, version)
        if self.in_place:
            self._pending[key] = reply
        else:
            if not self._free_buffers:  # the executor takes one visit's weights, then prefetches
                raise RuntimeError("more than two layers in flight: no free weight buffer")
            buffer = self._free_buffers.pop(0)
            self._pending[key] = self._copier.submit(self._land, layer, reply, buffer)

    def _land(self, layer: int, reply: Future, buffer: int):
        """Copier thread: wait for the EPS's answer, then copy the layer into ``buffer``."""
        ready, frames = self.client.wait(reply)
        plan = self.layout.layers[layer]
        src = layer_view(self.regions, plan, ready, frames)
        dst = self.buffers[buffer][:plan.numel]
        with self.tracer.span(f"copy L{layer}", "h2d"), self.streams.on(self.streams.h2d):
            self.streams.wait(self._released[buffer], self.streams.h2d)
            dst.copy_(src, non_blocking=True)
            landed = self.streams.event(self.streams.h2d)
        return ready, dst, landed, buffer, frames

    def _local_ready(self, layer: int) -> LayerReady:
        """What the EPS would answer for a version it has already published."""
        plan = self.layout.layers[layer]
        dtype = self.served.dtype
        return LayerReady(req_id=0, layer=layer, version=int(self.board[layer]),
                          region=self.served.name, offset=plan.byte_offset(dtype),
                          nbytes=plan.nbytes(dtype), dtype=dtype)

    def weights(self, layer: int, version: int) -> torch.Tensor:
        self._request(layer, version)
        fut = self._pending.pop((layer, version))
        with self.tracer.span(f"wait L{layer}", "wait"):
            result = self.client.wait(fut)
        if self.in_place:
            ready, frames = result
            flat = layer_view(self.regions, self.layout.layers[layer], ready, frames)
            self._held[layer, version] = frames  # a frame must outlive the views of it
        else:
            ready, flat, landed, buffer, frames = result
            self.streams.wait(landed)
            self._held[layer, version] = buffer
        if ready.version != version:
            raise RuntimeError(f"layer {layer}: got version {ready.version}, need {version}")
        self._scales[version] = ready.loss_scale
        self._scales.pop(version - 2, None)
        return flat

    def loss_scale(self, version: int) -> float:
        """The fp16 loss scale of step ``version`` (1.0 otherwise), as the EPS sent it with the
        step's weights."""
        return self._scales.get(version, 1.0)

    def release(self, layer: int, version: int) -> None:
        held = self._held.pop((layer, version), None)
        if not self.in_place:
            self._released[held] = self.streams.event()
            self._free_buffers.append(held)

    # ------------------------------------------------------------------------- gradients

    def grad_buffer(self, plan: LayerPlan) -> tuple[int, torch.Tensor]:
        self._raise_refused()
        with self.tracer.span("wait slot", "wait"):
            slot = self.slots.acquire(self.timeout)
        if self.in_slot:
            return slot, self.shared.slot(slot, plan)
        return slot, self.local[slot][:plan.numel]

    def push(self, step: int, plan: LayerPlan, slot: int, buf: torch.Tensor) -> None:
        for start, end in self._gaps[plan.index]:  # padding: the slot may hold older data
            buf[start:end].zero_()
        if self._pusher is not None:
            done = self.streams.event()
            self._pushes.append(self._pusher.submit(self._push_from_device, step, plan, slot,
                                                    buf, done))
        else:
            self._pushes.append(self._send(step, plan, slot, self._outgoing(slot, plan, buf)))
        if not self.overlap:
            self.drain()  # the non-overlapped path: wait for the EPS before computing on

    def _outgoing(self, slot: int, plan: LayerPlan, buf: torch.Tensor):
        """Put the accumulated gradient where the EPS reads it, in the wire dtype. Returns the
        frame to send (frames transport) or None (it is in the shared slot)."""
        if self.in_slot:
            return None
        cuda = self._pusher is not None
        if self.shared is not None:
            self.shared.slot(slot, plan).copy_(buf, non_blocking=cuda)
            return None
        host = self.staging[slot][:plan.numel] if self.staging else buf
        if host is not buf:
            host.copy_(buf, non_blocking=cuda)
        return host.view(torch.uint8).numpy().data

    def _push_from_device(self, step, plan, slot, buf, done) -> Future:
        """Pusher thread (CUDA): device gradient -> pinned host (shared slot or staging)."""
        try:
            with self.tracer.span(f"d2h L{plan.index}", "d2h"), self.streams.on(self.streams.d2h):
                self.streams.wait(done, self.streams.d2h)
                data = self._outgoing(slot, plan, buf)
                self.streams.event(self.streams.d2h).synchronize()
        except BaseException:
            self.slots.release(slot)
            raise
        return self._send(step, plan, slot, data)

    def _send(self, step: int, plan: LayerPlan, slot: int, data) -> Future:
        fut = self.client.push_grad(step=step, layer=plan.index, rank=self.rank,
                                    slot=-1 if data is not None else slot,
                                    dtype=self.grad_dtype_name, data=data)
        fut.add_done_callback(lambda _f: self.slots.release(slot))
        return fut

    def drain(self) -> None:
        """Wait until every push of the step is acknowledged; raise the first refusal."""
        pushes, self._pushes = self._pushes, []
        for fut in pushes:
            if self._pusher is not None:
                fut = fut.result(self.timeout)
            with self.tracer.span("wait acks", "wait"):
                self.client.wait(fut)

    def _raise_refused(self) -> None:
        for fut in self._pushes:
            if fut.done() and fut.exception() is not None:
                raise fut.exception()
            if fut.done() and self._pusher is not None:
                inner = fut.result()
                if inner.done() and inner.exception() is not None:
                    raise inner.exception()

    # ------------------------------------------------------------------------- stash arena

    def stash_arena(self, nbytes: int) -> Region:
        """A shared-memory arena owned by the EPS for this worker's stash (``--stash eps``)."""
        reply = self.client.call(StashArena, nbytes=nbytes)
        return self.regions.attach(reply.region, writable=True)

    def close(self) -> None:
        for fut in self._pending.values():
            fut.cancel()
        for pool in (self._copier, self._pusher):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()
        self._held.clear()
        self.regions.close()
