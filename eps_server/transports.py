"""How weights leave the EPS and gradients arrive, one class per transport (chosen at Hello).

    shm     same box: a LayerReady names a region and offset of the EPS's shared memory, and a
            PushGrad names one of the rank's gradient slots there
    frames  any reachable peer: the layer's bytes travel as a tensor frame (zero-copy out of
            the region), and so does the gradient

Adding a transport (e.g. torch.distributed between EPS processes) is one more class here and
its counterpart in worker/; the core calls only ``welcome``, ``layer_out`` and ``gradient_in``.
"""

from __future__ import annotations

import warnings

import torch

from protocol.messages import PushGrad, RegionInfo
from protocol.shm import Region
from protocol.tensors import DTYPES, LayerPlan

from .errors import RequestError
from .layer_store import LayerStore


class ShmTransport:
    name = "shm"

    def __init__(self, store: LayerStore, rank: int, grad_dtype: str, slots: int,
                 fresh: bool = False):
        self.store, self.rank, self.grad_dtype, self.slots = store, rank, grad_dtype, slots
        try:
            self.grads = store.grad_region(rank, grad_dtype, slots, fresh)
        except OSError as e:
            raise RequestError("resource", f"cannot create gradient slots: {e}") from None

    def welcome(self) -> dict:
        g = self.grads
        return {"grads": RegionInfo(name=g.name, nbytes=g.nbytes, dtype=self.grad_dtype),
                "versions": self.store.versions_info(), "retained": self.store.retained_info()}

    def layer_out(self, region: Region, offset: int, nbytes: int) -> tuple[str, int, tuple]:
        """(region name, byte offset, frames) of a LayerReady."""
        return region.name, offset, ()

    def gradient_in(self, msg: PushGrad, frames: list, plan: LayerPlan) -> torch.Tensor:
        if frames:
            if msg.slot != -1:
                raise RequestError("bad_request", "slot must be -1 with a tensor frame", "slot")
            return frame_tensor(frames[0], msg.dtype, plan.trainable)
        if not 0 <= msg.slot < self.slots:
            raise RequestError("bad_request", f"slot must be in [0, {self.slots})", "slot")
        return self.grads.tensor(DTYPES[msg.dtype],
                                 msg.slot * self.store.layout.max_trainable_numel,
                                 plan.trainable)


class FramesTransport:
    name = "frames"

    def welcome(self) -> dict:
        return {"grads": None, "versions": None}

    def layer_out(self, region: Region, offset: int, nbytes: int) -> tuple[str, int, tuple]:
        # Zero-copy: the layer is not rewritten before this worker pushes its gradient.
        return "", 0, (region.base[offset:offset + nbytes].numpy().data,)

    def gradient_in(self, msg: PushGrad, frames: list, plan: LayerPlan) -> torch.Tensor:
        if not frames:
            raise RequestError("bad_request", "frames transport: send the gradient as a "
                               "tensor frame", "frames")
        if msg.slot != -1:
            raise RequestError("bad_request", "slot must be -1 with a tensor frame", "slot")
        return frame_tensor(frames[0], msg.dtype, plan.trainable)


def make_transport(name: str, store: LayerStore, rank: int, grad_dtype: str, slots: int,
                   fresh: bool = False):
    """``fresh``: new gradient slots even if the rank had some (a replacement)."""
    if name == "shm":
        return ShmTransport(store, rank, grad_dtype, slots, fresh)
    return FramesTransport()


def frame_tensor(frame: memoryview, dtype: str, numel: int) -> torch.Tensor:
    """A tensor over a received frame (which it keeps alive), checked for its size."""
    want = numel * DTYPES[dtype].itemsize
    if frame.nbytes != want:
        raise RequestError("bad_request", f"tensor frame has {frame.nbytes} bytes, expected "
                           f"{want}", "frames")
    if not numel:  # (torch.frombuffer refuses an empty buffer)
        return torch.empty(0, dtype=DTYPES[dtype])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only frame; never written
        return torch.frombuffer(frame, dtype=DTYPES[dtype], count=numel)


def initial_values(frame: memoryview, plan: LayerPlan, frozen_dtype: str,
                   compute_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An InitLayer's frame: the layer in fp32, whole (and None), or its trainable prefix in
    fp32 and its frozen tail in the compute dtype."""
    if frozen_dtype == "float32":
        return frame_tensor(frame, "float32", plan.numel), None
    if frozen_dtype != compute_dtype:
        raise RequestError("bad_request", f"frozen tensors come in float32 or the compute "
                           f"dtype ({compute_dtype})", "frozen_dtype")
    frame, cut = memoryview(frame).cast("B"), 4 * plan.trainable
    return (frame_tensor(frame[:cut], "float32", plan.trainable),
            frame_tensor(frame[cut:], frozen_dtype, plan.numel - plan.trainable))
