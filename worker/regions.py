"""The worker's view of the EPS's memory: mapped regions, layer views, gradient slots.

- Weights: a LayerReady names a region and offset (shm) or carries the bytes (frames);
  ``layer_view`` returns a tensor over them, checked against the layer's plan.
- Gradient slots: ``grad_slots`` slots of the largest trainable prefix (``Layout.
  max_trainable_numel``: a layer whole unless tensors are frozen) in the rank's region; a slot
  is taken before a layer's backward and given back when the EPS acks the push (it has been
  reduced). ``SlotRing`` hands them out.
- On CUDA every mapping is registered as pinned memory once (cudaHostRegister), so host<->device
  copies from and into the EPS's shared memory are asynchronous DMA. Where the GPU cannot
  register read-only mappings (cudaDevAttrHostRegisterReadOnlySupported = 0, common on x86),
  the weights are mapped writable and shared instead (never written here; a private
  copy-on-write mapping would be pinned as a stale copy).
"""

from __future__ import annotations

import logging
import queue
import warnings

import torch

from protocol.messages import LayerReady, RegionInfo, Welcome
from protocol.shm import Region
from protocol.tensors import DTYPES, LayerPlan, Layout

from .streams import read_only_registration_supported, register_host, unregister_host

log = logging.getLogger(__name__)


def frombuffer(buf, dtype: torch.dtype) -> torch.Tensor:
    if memoryview(buf).nbytes == 0:  # (torch.frombuffer refuses an empty buffer)
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers are never written
        return torch.frombuffer(buf, dtype=dtype)


class Regions:
    """The EPS regions this worker maps (read-only weights, read-write slots and stash)."""

    def __init__(self, pin: bool, device: torch.device | None = None):
        self.pin = pin
        self.device = device
        self._read_only_ok: bool | None = None  # asked of the driver on the first pin
        self._regions: dict[str, Region] = {}
        self._pinned: list[torch.Tensor] = []
        self.registered = 0  # mappings page-locked for the GPU
        self.refused = 0  # mappings the driver would not register (copied from pageable memory)

    def attach(self, info: RegionInfo, writable: bool, pin: bool = True) -> Region:
        """Map a region; on CUDA also register it (``pin``) if copies to or from the GPU use
        it (not, e.g., the fp32 master under bf16 compute: only rank 0 reads it, to save)."""
        region = self._regions.get(info.name)
        if region is None:
            pin = self.pin and pin and info.nbytes > 0
            mapped_writable = writable or (pin and not self._read_only_registers())
            region = Region.attach(info.name, info.nbytes, writable=mapped_writable)
            self._regions[info.name] = region
            if pin:
                if register_host(region.base, read_only=not mapped_writable):
                    self._pinned.append(region.base)
                    self.registered += 1
                else:
                    self.refused += 1
        return region

    def _read_only_registers(self) -> bool:
        if self._read_only_ok is None:
            found = read_only_registration_supported(self.device or torch.device("cuda"))
            self._read_only_ok = found is not False  # unknown: try, a refusal is logged
            if not self._read_only_ok:
                log.info("this GPU cannot register read-only memory: the EPS's weights are "
                         "mapped writable (and never written) so they can be pinned")
        return self._read_only_ok

    def get(self, name: str) -> Region:
        region = self._regions.get(name)
        if region is None:
            raise RuntimeError(f"the EPS named an unknown region {name!r}")
        return region

    def detach(self, region: Region) -> None:
        """Unmap a region no longer used (a replaced stash arena); on CUDA once no copy can be
        reading or writing it, and unregistered first."""
        if self._regions.pop(region.name, None) is None:
            return
        pinned = [b for b in self._pinned if b.data_ptr() == region.base.data_ptr()]
        if pinned:
            torch.cuda.synchronize(self.device)
            unregister_host(pinned[0])
            self._pinned = [b for b in self._pinned if b is not pinned[0]]
        del pinned  # the last view of the mapping here: close() can unmap it
        region.close()

    def close(self) -> None:
        if self._pinned:
            try:
                torch.cuda.synchronize()  # no copy may still be reading or writing a mapping
            except RuntimeError as e:  # a sticky CUDA error: the device is unusable anyway
                log.error("CUDA failed before the regions were released: %s", e)
        for base in self._pinned:
            unregister_host(base)
        self._pinned.clear()
        for region in self._regions.values():
            region.close()
        self._regions.clear()


def layer_view(regions: Regions, plan: LayerPlan, ready: LayerReady, frames,
               trained: bool = False) -> torch.Tensor:
    """The layer's flat bytes (``trained``: its trainable prefix), as a CPU tensor over shared
    memory or the received frame."""
    if ready.layer != plan.index:
        raise RuntimeError(f"asked for layer {plan.index}, got {ready.layer}")
    dtype = DTYPES[ready.dtype]
    numel = plan.trainable if trained else plan.numel
    if ready.nbytes != numel * dtype.itemsize:
        raise RuntimeError(f"layer {plan.index}: {ready.nbytes} bytes, expected "
                           f"{numel * dtype.itemsize}")
    if frames:
        return frombuffer(frames[0], dtype)
    if ready.offset % dtype.itemsize:
        raise RuntimeError(f"misaligned offset {ready.offset}")
    return regions.get(ready.region).tensor(dtype, ready.offset // dtype.itemsize, numel)


class SlotRing:
    """Gradient slots: indices handed out and given back (from the client's I/O thread)."""

    def __init__(self, slots: int):
        self.size = slots
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for s in range(slots):
            self._free.put(s)

    def acquire(self, timeout: float) -> int:
        try:
            return self._free.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no gradient slot acknowledged by the EPS within {timeout:.0f} s"
                               ) from None

    def release(self, slot: int) -> None:
        self._free.put(slot)


class GradSlots:
    """The rank's gradient-slot region (shm transport): slot s holds a layer's flat gradient
    (its trainable prefix)."""

    def __init__(self, regions: Regions, welcome: Welcome, layout: Layout, dtype: torch.dtype):
        self.region = regions.attach(welcome.grads, writable=True)
        self.stride = layout.max_trainable_numel
        self.dtype = dtype

    def slot(self, slot: int, plan: LayerPlan) -> torch.Tensor:
        return self.region.tensor(self.dtype, slot * self.stride, plan.trainable)


def padding_gaps(plan: LayerPlan) -> list[tuple[int, int]]:
    """[start, end) element spans of a layer's flat buffer that hold no tensor."""
    gaps, pos = [], 0
    for s in sorted(plan.tensors, key=lambda s: s.offset):
        if s.offset > pos:
            gaps.append((pos, s.offset))
        pos = s.offset + s.numel
    if pos < plan.numel:
        gaps.append((pos, plan.numel))
    return gaps


def trained(plans) -> list[tuple[list[str], list, set[str]]]:
    """Per layer: its own trained tensors' names, its ties to trained tensors, and the names
    of both: what gets a weight gradient (--freeze: the rest is back-propagated through)."""
    group = {(p.index, s.name): s.group for p in plans for s in p.tensors}
    out = []
    for p in plans:
        own = [s.name for s in p.tensors if s.group != "frozen"]
        ties = [t for t in p.ties if group[t.owner, t.tensor] != "frozen"]
        out.append((own, ties, {*own, *(t.name for t in ties)}))
    return out
