"""LoRA (Hu et al., 2021) as PEFT makes it, on the blocks of a Hugging Face model
(``--lora-rank``): each targeted ``nn.Linear`` computes ``x W^T + b + s * B(A(dropout(x)))``
with ``s = alpha / r``, ``A`` (r x in) initialised kaiming-uniform (a = sqrt(5)) and ``B``
(out x r) zero, as PEFT's ``init_lora_weights=True`` does. The adapter's tensors are the
targeted module's ``lora_A.weight`` and ``lora_B.weight``: in a layer's manifest beside the
base weights, which are frozen (protocol/tensors.py "frozen"): the EPS holds the base model's
served copy only, and a master and optimizer state for the adapter.

``adapter_files`` writes what ``PeftModel.from_pretrained(base, DIR)`` loads
(``adapter_config.json``, ``adapter_model.safetensors``: PEFT's names), ``merged`` folds the
adapter into the base weights (``W + s * B @ A``) for a plain model.
"""

from __future__ import annotations

import json
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from protocol.safetensors_io import write_safetensors
from protocol.tensors import LayerPlan

ADAPTER = (".lora_A.weight", ".lora_B.weight")


def is_adapter(tensor: str) -> bool:
    return tensor.endswith(ADAPTER)


class LoraLinear(nn.Linear):
    """An ``nn.Linear`` with a LoRA update (its class is swapped in by ``apply``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def targets(spec: str) -> tuple[str, ...] | None:
    """``--lora-targets``: module names (the last part of a qualified name), or None for
    every linear layer of the blocks ("all-linear")."""
    if spec.strip() == "all-linear":
        return None
    return tuple(t.strip() for t in spec.split(",") if t.strip())


def apply(module: nn.Module, rank: int, alpha: float, spec: str, dropout: float) -> set[str]:
    """Add LoRA to the targeted linear layers of ``module`` (one stage); their names."""
    want = targets(spec)
    found = [(n, m) for n, m in module.named_modules() if type(m) is nn.Linear and
             (want is None or n.rpartition(".")[2] in want)]
    for _, lin in found:
        kw = {"device": lin.weight.device, "dtype": lin.weight.dtype}
        lin.lora_A = nn.Linear(lin.in_features, rank, bias=False, **kw)
        lin.lora_B = nn.Linear(rank, lin.out_features, bias=False, **kw)
        lin.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        lin.scaling = alpha / rank
        lin.__class__ = LoraLinear
    return {n.rpartition(".")[2] for n, _ in found}


class LoraInit:
    """A weight loader: the base model's tensors from ``base`` (the checkpoint), the adapter's
    initialised as PEFT does, seeded by (seed, layer, tensor)."""

    def __init__(self, base, seed: int):
        self.base, self.seed = base, seed

    def load(self, plan: LayerPlan) -> dict[str, torch.Tensor]:
        from dataclasses import replace

        from .base import derive_seed

        own = tuple(s for s in plan.tensors if not is_adapter(s.name))
        out = self.base.load(replace(plan, tensors=own))
        for s in plan.tensors:
            if s.name.endswith(".lora_A.weight"):
                gen = torch.Generator().manual_seed(derive_seed(self.seed, "lora", plan.index,
                                                                s.name))
                t = torch.empty(s.shape)
                bound = 1 / math.sqrt(s.shape[1])  # kaiming_uniform_(a=sqrt(5)): 1/sqrt(fan_in)
                out[s.name] = t.uniform_(-bound, bound, generator=gen)
            elif s.name.endswith(".lora_B.weight"):
                out[s.name] = torch.zeros(s.shape)
        return out


def adapter_files(path: str, named: dict[str, torch.Tensor], config: dict) -> None:
    """PEFT's adapter directory: ``named`` maps the library's tensor names to the adapter's
    tensors."""
    if os.path.isdir(path) and os.listdir(path) and not os.path.isfile(
            os.path.join(path, "adapter_config.json")):
        raise ValueError(f"{path} is a non-empty directory that is not an adapter; not "
                         "writing into it")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    write_safetensors(os.path.join(path, "adapter_model.safetensors"),
                      [(f"base_model.model.{n}", t.contiguous()) for n, t in named.items()],
                      {"format": "pt"})


def merged(tensors: dict[tuple[str, str], torch.Tensor], scaling: float) -> dict:
    """The base weights with each adapter folded in (W + s * B @ A), the adapter left out."""
    out = {k: v for k, v in tensors.items() if not is_adapter(k[1])}
    for (layer, name), a in tensors.items():
        if name.endswith(".lora_A.weight"):
            prefix = name[:-len(".lora_A.weight")]
            b = tensors[layer, prefix + ".lora_B.weight"]
            out[layer, prefix + ".weight"] = out[layer, prefix + ".weight"] + scaling * (b @ a)
    return out
