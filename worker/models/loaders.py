"""Initial weights, one layer at a time: a bootstrapping worker sends layer l's values without
building (or reading) the others, so a model never has to fit in the worker whole.

    RandomInit        the model's seeded initialisation (a pure function of seed and layer)
    SafetensorsInit   a safetensors file of the assembled model (``<layer>.<tensor>`` names, as
                      ``--save`` writes them), its tensors read as views of the mapped file

A loader returns a layer's *own* tensors by name (tied tensors come from their owner layer), in
whatever dtype they are stored; ``flat_of`` converts them as it copies them into place.
"""

from __future__ import annotations

import torch

from protocol.safetensors_io import SafetensorsFile
from protocol.tensors import LayerPlan, named_views


class RandomInit:
    def __init__(self, model):
        self.model = model

    def load(self, plan: LayerPlan) -> dict[str, torch.Tensor]:
        own = {s.name for s in plan.tensors}
        module = self.model.init_stage(plan.index)
        return {n: p.detach() for n, p in module.named_parameters() if n in own}


class SafetensorsInit:
    def __init__(self, path: str):
        self.path = path
        try:
            self._file = SafetensorsFile(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read initial weights from {path}: {e}") from None

    def load(self, plan: LayerPlan) -> dict[str, torch.Tensor]:
        out = {}
        for slot in plan.tensors:
            key = f"{plan.name}.{slot.name}"
            if key not in self._file:
                raise ValueError(f"{self.path} has no tensor {key!r} (layer {plan.name!r})")
            t = self._file.get(key)
            if tuple(t.shape) != slot.shape:
                raise ValueError(f"{self.path}: {key} has shape {tuple(t.shape)}, the model "
                                 f"needs {slot.shape}")
            out[slot.name] = t
        return out


def flat_of(loader, plan: LayerPlan, out: torch.Tensor | None = None) -> torch.Tensor:
    """A layer's initial values in its flat fp32 layout (padding zero), in ``out`` (at least
    ``plan.numel`` elements) when given."""
    flat = torch.zeros(plan.numel) if out is None else out[:plan.numel].zero_()
    values = loader.load(plan)
    for name, view in named_views(flat, plan).items():
        view.copy_(values[name])
    return flat


def init_frame(loader, plan: LayerPlan, out: torch.Tensor, frozen: torch.dtype) -> torch.Tensor:
    """A layer's initial values as InitLayer sends them, in ``out`` (bytes, at least 4 x
    ``plan.numel``): its trainable prefix in fp32, then its frozen tail in ``frozen`` (padding
    zero). Returns the frame's bytes."""
    cut, size = 4 * plan.trainable, (plan.numel - plan.trainable) * frozen.itemsize
    frame = out[:cut + size].zero_()
    head, tail = frame[:cut].view(torch.float32), frame[cut:].view(frozen)
    values = loader.load(plan)
    for s in plan.tensors:
        part, at = (head, s.offset) if s.offset < plan.trainable else (
            tail, s.offset - plan.trainable)
        view = part[at:at + s.numel].view(s.shape)
        view.copy_(values[s.name])
        if part is tail and frozen == torch.float16 and not bool(view.isfinite().all()) and bool(
                values[s.name].isfinite().all()):
            raise ValueError(f"{plan.name}.{s.name} (frozen) has values beyond float16's range "
                             "(65504): --precision fp16 cannot serve it (bf16 can)")
    return frame
