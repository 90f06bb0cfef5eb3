"""How a worker's layer gradients reach the EPS (a gradient path, chosen once in source.py).

A layer's micro-batch gradients are summed in fp32 into a buffer taken from a slot ring
(``grad_slots`` slots; one comes back when the EPS acks the push that used it), then pushed:

    SlotGrads     shm, CPU, fp32 on the wire: accumulate straight into the shared slot
    StagedGrads   accumulate in a local fp32 buffer; at push time an outgoing target puts it
                  in the wire dtype where the EPS reads it: ToSlot (the shared slot, shm) or
                  ToFrame (a staging buffer, or the buffer itself, sent as a tensor frame)
    DeviceGrads   CUDA: as StagedGrads, with the device-to-host copy done by a pusher thread
                  on a side stream, after the compute stream's event

Pushes are asynchronous; every push is one Future resolved by the EPS's GradAck (or Error).
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from protocol.tensors import LayerPlan, Layout
from protocol.trace import NULL, Tracer

from .eps_client import EpsClient
from .regions import GradSlots, SlotRing, padding_gaps
from .streams import Streams


class GradPath:
    def __init__(self, client: EpsClient, layout: Layout, *, rank: int, dtype: str, slots: int,
                 timeout: float, tracer: Tracer = NULL):
        self.client, self.layout, self.rank, self.dtype = client, layout, rank, dtype
        self.timeout, self.tracer = timeout, tracer
        self.slots = SlotRing(slots)
        self._gaps = {p.index: padding_gaps(p) for p in layout.layers}
        self._pushes: list[Future] = []

    def buffer(self, plan: LayerPlan) -> tuple[int, torch.Tensor]:
        """(slot, flat fp32 buffer) to accumulate ``plan``'s gradient into: its trainable
        prefix."""
        self._raise_refused()
        with self.tracer.span("wait slot", "wait"):
            slot = self.slots.acquire(self.timeout)
        return slot, self._buffer(slot, plan)

    def push(self, step: int, plan: LayerPlan, slot: int, buf: torch.Tensor) -> None:
        """Push the layer's trainable prefix of ``buf`` (--freeze: the frozen tensors after it
        have no gradient); a layer with nothing trainable is pushed as a skip."""
        if not plan.trainable:
            self.slots.release(slot)
            return self.skip(step, plan)
        for start, end in self._gaps[plan.index]:  # padding: the slot may hold older data
            buf[start:end].zero_()
        self._pushes.append(self._push(step, plan, slot, buf))

    def skip(self, step: int, plan: LayerPlan) -> None:
        """Tell the EPS this worker has no gradient of the layer this step (LayerDrop; a
        layer that trains nothing)."""
        self._pushes.append(self.client.push_grad(step=step, layer=plan.index, rank=self.rank,
                                                  slot=-1, dtype=self.dtype, skip=True))

    def drain(self) -> None:
        """Wait until every push so far is acknowledged; raise the first refusal."""
        pushes, self._pushes = self._pushes, []
        for fut in pushes:
            with self.tracer.span("wait acks", "wait"):
                self.client.wait(fut)

    def close(self) -> None:
        pass

    def _raise_refused(self) -> None:
        for fut in self._pushes:
            if fut.done() and fut.exception() is not None:
                raise fut.exception()

    def _send(self, step: int, plan: LayerPlan, slot: int, data) -> Future:
        """Push (``data``: a frame, or None when the gradient is in the shared slot); the slot
        comes back with the reply."""
        fut = self.client.push_grad(step=step, layer=plan.index, rank=self.rank,
                                    slot=-1 if data is not None else slot, dtype=self.dtype,
                                    data=data)
        fut.add_done_callback(lambda _f: self.slots.release(slot))
        return fut

    def _buffer(self, slot: int, plan: LayerPlan) -> torch.Tensor:
        raise NotImplementedError

    def _push(self, step: int, plan: LayerPlan, slot: int, buf: torch.Tensor) -> Future:
        raise NotImplementedError


class SlotGrads(GradPath):
    def __init__(self, *args, shared: GradSlots, **kw):
        super().__init__(*args, **kw)
        self.shared = shared

    def _buffer(self, slot, plan):
        return self.shared.slot(slot, plan)

    def _push(self, step, plan, slot, buf):
        return self._send(step, plan, slot, None)


class ToSlot:
    """Into the rank's shared gradient slot (shm), converted to the wire dtype."""

    def __init__(self, shared: GradSlots, non_blocking: bool = False):
        self.shared, self.non_blocking = shared, non_blocking

    def put(self, slot: int, plan: LayerPlan, buf: torch.Tensor):
        n = plan.trainable
        self.shared.slot(slot, plan)[:n].copy_(buf[:n], non_blocking=self.non_blocking)
        return None


class ToFrame:
    """Into a host staging buffer in the wire dtype (pinned on CUDA) sent as a frame; without
    staging (CPU, fp32) the accumulator itself is the frame."""

    def __init__(self, staging: list[torch.Tensor], non_blocking: bool = False):
        self.staging, self.non_blocking = staging, non_blocking

    def put(self, slot: int, plan: LayerPlan, buf: torch.Tensor):
        n = plan.trainable
        host = self.staging[slot][:n] if self.staging else buf[:n]
        if self.staging:
            host.copy_(buf[:n], non_blocking=self.non_blocking)
        return host.view(torch.uint8).numpy().data


class StagedGrads(GradPath):
    def __init__(self, *args, device: torch.device, out: ToSlot | ToFrame, **kw):
        super().__init__(*args, **kw)
        self.out = out
        self.local = [torch.empty(self.layout.max_trainable_numel, dtype=torch.float32,
                                  device=device) for _ in range(self.slots.size)]

    def _buffer(self, slot, plan):
        return self.local[slot][:plan.trainable]

    def _push(self, step, plan, slot, buf):
        return self._send(step, plan, slot, self.out.put(slot, plan, buf))


class DeviceGrads(StagedGrads):
    def __init__(self, *args, delays: dict[str, int] | None = None, **kw):
        super().__init__(*args, **kw)
        self.streams = Streams(kw["device"], delays)
        self._pusher = self.streams.thread_pool("l2l-push")

    def _push(self, step, plan, slot, buf):
        computed = self.streams.event()
        result: Future = Future()
        self._pusher.submit(self._from_device, step, plan, slot, buf, computed, result)
        return result

    def _from_device(self, step, plan, slot, buf, computed, result: Future) -> None:
        """Pusher thread: device gradient -> pinned host (shared slot or staging) -> push."""
        try:
            with self.tracer.span(f"d2h L{plan.index}", "d2h"), \
                    self.streams.on(self.streams.d2h):
                self.streams.wait(computed, self.streams.d2h)
                self.streams.stall("d2h", self.streams.d2h)
                data = self.out.put(slot, plan, buf)
                self.streams.event(self.streams.d2h, host_waits=True).synchronize()
            sent = self._send(step, plan, slot, data)
        except BaseException as e:
            self.slots.release(slot)
            result.set_exception(e)
            return
        sent.add_done_callback(lambda f: _settle(result, f))

    def close(self) -> None:
        self._pusher.shutdown(wait=True, cancel_futures=True)


def _settle(result: Future, source: Future) -> None:
    if source.cancelled():
        result.cancel()
    elif source.exception() is not None:
        result.set_exception(source.exception())
    else:
        result.set_result(source.result())
