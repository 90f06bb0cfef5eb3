"""How a worker gets a layer's weights: where they are (a locator) and how they reach the
compute device (a weight path). Both are chosen once, when the worker joins (source.py).

Locators answer "where is version v of layer l?" with a future of (LayerReady, frames):
    FetchLocator   a Fetch round trip (either transport)
    BoardLocator   shm: the version the EPS has published on its shared version board is
                   located without asking; else (not there yet, or already replaced: a worker
                   redoing a step reads a retained version) a Fetch

Weight paths hand the executor a flat tensor of the layer, one visit ahead:
    InPlaceWeights     CPU: the shared-memory region or received frame is used where it lies
    DeviceCopyWeights  a copier thread lands the layer in one of two device buffers on a side
                       stream, behind that buffer's "released" event; the compute stream waits
                       on its "landed" event (CUDA; on CPU, --copy-weights)
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from protocol.messages import LayerReady, RegionInfo
from protocol.tensors import DTYPES, Layout
from protocol.trace import NULL, Tracer

from .eps_client import EpsClient
from .regions import Regions, layer_view
from .streams import Streams


class FetchLocator:
    def __init__(self, client: EpsClient):
        self.client = client
        self.fast_fetches = 0  # located without a round trip (BoardLocator)
        self.ask: set[tuple[int, int]] = set()  # (layer, version) always fetched (source.redo)

    def locate(self, layer: int, version: int) -> Future:
        return self.client.fetch(layer, version)


class BoardLocator(FetchLocator):
    """Reads the EPS's version board (int64 per layer, shared memory). The EPS writes a layer's
    bytes before its version, and x86 keeps stores in order, so a version seen is complete."""

    def __init__(self, client: EpsClient, board: torch.Tensor, served: RegionInfo,
                 layout: Layout):
        super().__init__(client)
        self.board, self.served, self.layout = board, served, layout

    def locate(self, layer: int, version: int) -> Future:
        published = int(self.board[layer])
        if published != version or (layer, version) in self.ask:
            return super().locate(layer, version)
        plan, dtype = self.layout.layers[layer], self.served.dtype
        reply = Future()  # what the EPS would answer
        reply.set_result((LayerReady(req_id=0, layer=layer, version=published,
                                     region=self.served.name, offset=plan.byte_offset(dtype),
                                     nbytes=plan.nbytes(dtype), dtype=dtype), []))
        self.fast_fetches += 1
        return reply


class WeightPath:
    """Prefetch / take / release of layer weights, and the fp16 loss scale of each step (it
    comes with the step's weights)."""

    def __init__(self, locator: FetchLocator, client: EpsClient, regions: Regions,
                 layout: Layout, tracer: Tracer = NULL):
        self.locator, self.client, self.regions, self.layout = locator, client, regions, layout
        self.tracer = tracer
        self._pending: dict[tuple[int, int], Future] = {}
        self._held: dict[tuple[int, int], object] = {}
        self._scales: dict[int, float] = {}

    def prefetch(self, layer: int, version: int) -> None:
        if (layer, version) not in self._pending:
            self._pending[layer, version] = self._start(layer, version)

    def weights(self, layer: int, version: int) -> torch.Tensor:
        self.prefetch(layer, version)
        fut = self._pending.pop((layer, version))
        with self.tracer.span(f"wait L{layer}", "wait"):
            result = self.client.wait(fut)
        ready, flat, hold = self._finish(layer, result)
        self._held[layer, version] = hold
        if ready.version != version:
            raise RuntimeError(f"layer {layer}: got version {ready.version}, need {version}")
        self._scales[version] = ready.loss_scale
        self._scales.pop(version - 2, None)
        return flat

    def release(self, layer: int, version: int) -> None:
        self._release(self._held.pop((layer, version), None))

    def loss_scale(self, version: int) -> float:
        """The fp16 loss scale of step ``version`` (1.0 otherwise), as sent with its weights."""
        return self._scales.get(version, 1.0)

    def close(self) -> None:
        for fut in self._pending.values():
            fut.cancel()
        self._pending.clear()
        self._held.clear()

    def _start(self, layer: int, version: int) -> Future:
        raise NotImplementedError

    def _finish(self, layer: int, result) -> tuple[LayerReady, torch.Tensor, object]:
        raise NotImplementedError

    def _release(self, hold) -> None:
        pass


class InPlaceWeights(WeightPath):
    def _start(self, layer: int, version: int) -> Future:
        return self.locator.locate(layer, version)

    def _finish(self, layer: int, result):
        ready, frames = result
        flat = layer_view(self.regions, self.layout.layers[layer], ready, frames)
        return ready, flat, frames  # a frame must outlive the views of it


class DeviceCopyWeights(WeightPath):
    def __init__(self, *args, device: torch.device, compute_dtype: str,
                 delays: dict[str, int] | None = None, **kw):
        super().__init__(*args, **kw)
        self.streams = Streams(device, delays)
        n = self.layout.max_layer_numel
        self.buffers = [torch.empty(n, dtype=DTYPES[compute_dtype], device=device)
                        for _ in range(2)]
        # per buffer: event after its last reader; at first after its allocation (new memory
        # may be what compute-stream work still queued was freed from)
        self._released: list = [self.streams.event(), self.streams.event()]
        self._free = [0, 1]
        self._copier = self.streams.thread_pool("l2l-prefetch")

    def _start(self, layer: int, version: int) -> Future:
        if not self._free:  # the executor takes one visit's weights, then prefetches
            raise RuntimeError("more than two layers in flight: no free weight buffer")
        buffer = self._free.pop(0)
        return self._copier.submit(self._land, layer, self.locator.locate(layer, version),
                                   buffer)

    def _land(self, layer: int, reply: Future, buffer: int):
        """Copier thread: wait for the EPS's answer, then copy the layer into ``buffer``."""
        ready, frames = self.client.wait(reply)
        plan = self.layout.layers[layer]
        src = layer_view(self.regions, plan, ready, frames)
        dst = self.buffers[buffer][:plan.numel]
        with self.tracer.span(f"copy L{layer}", "h2d"), self.streams.on(self.streams.h2d):
            self.streams.wait(self._released[buffer], self.streams.h2d)
            self.streams.stall("copy", self.streams.h2d)
            dst.copy_(src, non_blocking=True)
            landed = self.streams.event(self.streams.h2d)
        return ready, dst, landed, buffer, frames

    def _finish(self, layer: int, result):
        ready, dst, landed, buffer, frames = result
        self.streams.wait(landed)
        return ready, dst, (buffer, frames)  # frames: the copy's source stays alive

    def _release(self, hold) -> None:
        buffer, _ = hold
        self._released[buffer] = self.streams.event()
        self._free.append(buffer)

    def close(self) -> None:
        super().close()
        self._copier.shutdown(wait=True, cancel_futures=True)
