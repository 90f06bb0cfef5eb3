"""The worker's data plane: layer weights in, layer gradients out.

Weights: the EPS answers a Fetch with a LayerReady naming where the layer's bytes are.
- shm transport, CPU device: the weights are used in place, as read-only views of the EPS's
  shared memory (the EPS never rewrites a version a worker may still read, see layer_store).
- shm transport, CUDA device: one copy into a persistent device buffer (two buffers, so the
  next layer can arrive while this one computes).
- frames transport: the bytes arrived as a ZeroMQ frame; used in place (CPU) or copied.

Gradients: ``grad_slots`` buffers in a ring. A slot is taken before a layer's backward, filled
with the layer's gradient summed over micro-batches, pushed, and given back when the EPS acks
it (it has been reduced). With shm on CPU a slot *is* the EPS's shared-memory slot, so the
gradient is accumulated straight into it; otherwise it is a local buffer that is copied (CUDA,
into the shared slot) or sent as a frame.
"""

from __future__ import annotations

import queue
import warnings

import torch

from protocol.messages import LayerReady, Welcome
from protocol.shm import Region
from protocol.tensors import DTYPES, Layout, LayerPlan


def _frombuffer(buf, dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers are never written
        return torch.frombuffer(buf, dtype=dtype)


class Transfer:
    def __init__(self, welcome: Welcome, layout: Layout, device: torch.device, transport: str,
                 grad_dtype: str):
        self.layout = layout
        self.device = device
        self.transport = transport
        self.compute_dtype = DTYPES[welcome.compute_dtype]
        self.grad_dtype_name = grad_dtype
        self.grad_dtype = DTYPES[grad_dtype]
        self.regions: dict[str, Region] = {}
        self._in_place = device.type == "cpu"
        if transport == "shm":
            for info in (welcome.master, welcome.compute):
                if info is not None:
                    self.regions[info.name] = Region.attach(info.name, info.nbytes,
                                                            writable=False)
        # Weight buffers on the device, used in turn (CUDA, or frames that must be copied).
        n = layout.max_layer_numel
        self._weight_bufs = ([] if self._in_place else
                             [torch.empty(n, dtype=self.compute_dtype, device=device)
                              for _ in range(2)])
        self._next_buf = 0
        # Gradient slots.
        self.slots = welcome.grad_slots
        self._shared_grads: Region | None = None
        if transport == "shm":
            g = welcome.grads
            self._shared_grads = Region.attach(g.name, g.nbytes, writable=True)
        self._local_grads = (
            [] if (self._shared_grads is not None and self._in_place) else
            [torch.empty(n, dtype=self.grad_dtype, device=device) for _ in range(self.slots)])
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for s in range(self.slots):
            self._free.put(s)
        self._gaps: dict[int, list[tuple[int, int]]] = {}

    # ------------------------------------------------------------------------- weights

    def weights(self, plan: LayerPlan, ready: LayerReady, frames) -> torch.Tensor:
        """The layer's flat weights on the compute device (see module doc)."""
        if ready.layer != plan.index:
            raise RuntimeError(f"asked for layer {plan.index}, got {ready.layer}")
        dtype = DTYPES[ready.dtype]
        if ready.nbytes != plan.numel * dtype.itemsize:
            raise RuntimeError(f"layer {plan.index}: {ready.nbytes} bytes, expected "
                               f"{plan.numel * dtype.itemsize}")
        if frames:
            src = _frombuffer(frames[0], dtype)
        else:
            region = self.regions.get(ready.region)
            if region is None:
                raise RuntimeError(f"LayerReady names unknown region {ready.region!r}")
            if ready.offset % dtype.itemsize:
                raise RuntimeError(f"misaligned offset {ready.offset}")
            src = region.tensor(dtype, ready.offset // dtype.itemsize, plan.numel)
        if self._in_place:
            return src
        buf = self._weight_bufs[self._next_buf][:plan.numel]
        self._next_buf ^= 1
        buf.copy_(src)
        return buf

    # ------------------------------------------------------------------------- gradients

    def acquire_slot(self, timeout: float) -> int:
        try:
            return self._free.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no gradient slot acknowledged by the EPS within {timeout:.0f} s"
                               ) from None

    def release_slot(self, slot: int) -> None:
        self._free.put(slot)

    def grad_buffer(self, slot: int, plan: LayerPlan) -> torch.Tensor:
        """Where this layer's gradient is accumulated (flat, the layer's layout)."""
        if self._local_grads:
            return self._local_grads[slot][:plan.numel]
        return self._shared_slot(slot, plan)

    def _shared_slot(self, slot: int, plan: LayerPlan) -> torch.Tensor:
        return self._shared_grads.tensor(self.grad_dtype, slot * self.layout.max_layer_numel,
                                         plan.numel)

    def zero_gaps(self, buf: torch.Tensor, plan: LayerPlan) -> None:
        """Zero the alignment padding of a gradient buffer (it may hold another layer's data),
        so padding stays zero on the EPS."""
        gaps = self._gaps.get(plan.index)
        if gaps is None:
            gaps, pos = [], 0
            for s in sorted(plan.tensors, key=lambda s: s.offset):
                if s.offset > pos:
                    gaps.append((pos, s.offset))
                pos = s.offset + s.numel
            if pos < plan.numel:
                gaps.append((pos, plan.numel))
            self._gaps[plan.index] = gaps
        for start, end in gaps:
            buf[start:end].zero_()

    def outgoing(self, slot: int, plan: LayerPlan, buf: torch.Tensor):
        """Make the accumulated gradient visible to the EPS: returns the frame to send (frames
        transport) or None (it is in the shared slot)."""
        if self.transport == "frames":
            host = buf if buf.device.type == "cpu" else buf.cpu()
            return host.view(torch.uint8).numpy().data
        if self._local_grads:  # device buffer -> shared slot
            self._shared_slot(slot, plan).copy_(buf)
        return None

    def close(self) -> None:
        for region in self.regions.values():
            region.close()
        if self._shared_grads is not None:
            self._shared_grads.close()
