"""Initial weights, one layer at a time: a bootstrapping worker sends layer l's values without
building (or reading) the others, so a model never has to fit in the worker whole.

    RandomInit        the model's seeded initialisation (a pure function of seed and layer)
    SafetensorsInit   a safetensors file of the assembled model (``<layer>.<tensor>`` names, as
                      ``--save`` writes them), read tensor by tensor (safe_open)

A loader returns a layer's *own* tensors by name (tied tensors come from their owner layer).
"""

from __future__ import annotations

import torch
from safetensors import safe_open

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
            self._file = safe_open(path, framework="pt")
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"cannot read initial weights from {path}: {e}") from None
        self._keys = set(self._file.keys())

    def load(self, plan: LayerPlan) -> dict[str, torch.Tensor]:
        out = {}
        for slot in plan.tensors:
            key = f"{plan.name}.{slot.name}"
            if key not in self._keys:
                raise ValueError(f"{self.path} has no tensor {key!r} (layer {plan.name!r})")
            t = self._file.get_tensor(key)
            if tuple(t.shape) != slot.shape:
                raise ValueError(f"{self.path}: {key} has shape {tuple(t.shape)}, the model "
                                 f"needs {slot.shape}")
            out[slot.name] = t.to(torch.float32)
        return out


def flat_of(loader, plan: LayerPlan) -> torch.Tensor:
    """A layer's initial values in its flat fp32 layout (padding zero)."""
    flat = torch.zeros(plan.numel, dtype=torch.float32)
    values = loader.load(plan)
    for name, view in named_views(flat, plan).items():
        view.copy_(values[name])
    return flat
