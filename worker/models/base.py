"""Layered models: ``pre`` (embeddings) -> N identical ``blocks`` -> ``post`` (head + loss).

A layered model is what the L2L loop needs to know about a network:
- its layers, in order, each with a *stage kind*; every layer of one kind has the same tensors;
- for each kind, a module class computing ``stage(x, batch) -> x`` (``post`` returns the loss);
- a deterministic initial value for every layer (a pure function of seed and layer index, so a
  worker can produce layer l without building the others);
- the same network as one ordinary ``nn.Module`` (``assemble``), for baselines and export.

Stage calls are ``forward(x, batch)``: ``x`` is the boundary activation (None for ``pre``) and
``batch`` the micro-batch (inputs, targets, loss normaliser). ``post.forward`` returns
``(loss, correct)``: the micro-batch's loss already divided by the *global* minibatch's
normaliser (so summing over micro-batches and workers gives the global mean), and its count of
correct predictions.
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn

from protocol.tensors import LayerPlan, LayerSpec, Manifest, TensorSpec, views


@dataclass(frozen=True)
class Batch:
    """One micro-batch. ``norm`` is the number of loss terms in the whole global minibatch."""

    inputs: torch.Tensor  # (B, T) int64 token ids
    targets: torch.Tensor  # (B,) class ids or (B, T) next-token ids
    norm: float

    def to(self, device: torch.device) -> Batch:
        return Batch(self.inputs.to(device, non_blocking=True),
                     self.targets.to(device, non_blocking=True), self.norm)


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed that is a pure function of ``parts`` (seed, purpose, step, layer, ...)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(str(p).encode() + b"\x00")
    return struct.unpack("<Q", h.digest())[0] >> 1


@contextlib.contextmanager
def seeded(seed: int, device: torch.device, enabled: bool = True) -> Iterator[None]:
    """Run a stage with the RNG (CPU and the stage's CUDA device) seeded to ``seed`` and restored
    afterwards, so the forward and the recompute of a layer draw the same dropout masks."""
    if not enabled:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.manual_seed(seed)
        yield


def dropout_seed(seed: int, step: int, layer: int, micro_batch: int) -> int:
    """Dropout RNG of (step, layer, *global* micro-batch): independent of execution order and of
    how the minibatch is split across workers."""
    return derive_seed(seed, "dropout", step, layer, micro_batch)


def init_params(module: nn.Module, gen: torch.Generator, std: float = 0.02) -> None:
    """GPT-2/BERT style: N(0, std) for matrices and embeddings, 1 for norm scales, 0 for biases."""
    with torch.no_grad():
        for mod in module.modules():
            for name, p in mod.named_parameters(recurse=False):
                if isinstance(mod, nn.LayerNorm) and name == "weight":
                    p.fill_(1.0)
                elif p.ndim >= 2:
                    p.normal_(0.0, std, generator=gen)
                else:
                    p.zero_()


def param_group(name: str, p: torch.Tensor) -> str:
    """Optimizer group: no weight decay for vectors (biases, norm scales)."""
    return "decay" if p.ndim >= 2 else "no_decay"


class Binder:
    """Binds one template module (per stage kind, on the compute device, holding no weights of
    its own) to a layer's weights for one visit: the module's parameter slots are pointed at
    views of the layer's flat buffer. Binding costs one dict assignment per tensor per visit;
    calls within the visit (all micro-batches) pay nothing."""

    def __init__(self, module: nn.Module):
        self.module = module
        self._slots = []
        for name, _ in module.named_parameters():
            owner_name, _, attr = name.rpartition(".")
            self._slots.append((module.get_submodule(owner_name), attr))

    def bind(self, tensors: list[torch.Tensor]) -> nn.Module:
        if len(tensors) != len(self._slots):
            raise ValueError(f"{len(tensors)} tensors for {len(self._slots)} parameters")
        for (owner, attr), t in zip(self._slots, tensors):
            owner._parameters[attr] = t  # plain tensor, not a Parameter: a view of the layer
        return self.module


class LayeredModel:
    """Base class; subclasses define ``kinds`` (kind -> module factory) and ``layer_kinds``."""

    name = "base"

    def __init__(self, cfg):
        self.cfg = cfg

    # -- to be provided by subclasses -------------------------------------------------------

    def make_stage(self, kind: str) -> nn.Module:
        raise NotImplementedError

    def layer_kinds(self) -> list[tuple[str, str]]:
        """(layer name, stage kind) in execution order: ("pre", ...), ("blocks.i", ...),
        ("post", ...). Names are the prefixes of the assembled module's state dict."""
        raise NotImplementedError

    def meta(self) -> dict[str, str | int | float | bool]:
        """Architecture facts that must agree between workers (part of the manifest hash)."""
        raise NotImplementedError

    # -- derived ------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds())

    def manifest(self) -> Manifest:
        layers = []
        specs: dict[str, tuple[TensorSpec, ...]] = {}
        for name, kind in self.layer_kinds():
            if kind not in specs:
                with torch.device("meta"):
                    module = self.make_stage(kind)
                specs[kind] = tuple(
                    TensorSpec(name=n, shape=tuple(p.shape), group=param_group(n, p))
                    for n, p in module.named_parameters())
            layers.append(LayerSpec(name=name, kind=kind, tensors=specs[kind]))
        return Manifest(layers=tuple(layers), meta=self.meta())

    def template(self, kind: str) -> Binder:
        """A module of ``kind`` built on the meta device (it owns no memory); its parameters
        are bound to a layer's weights on each visit, on whatever device those live."""
        with torch.device("meta"):
            return Binder(self.make_stage(kind))

    def init_stage(self, index: int) -> nn.Module:
        """Layer ``index`` as a module holding its initial weights (pure function of the seed)."""
        _, kind = self.layer_kinds()[index]
        module = self.make_stage(kind)
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, "init", index))
        init_params(module, gen)
        return module

    def init_flat(self, index: int, plan: LayerPlan) -> torch.Tensor:
        """Initial weights of layer ``index`` in its flat fp32 layout (padding zero)."""
        flat = torch.zeros(plan.numel, dtype=torch.float32)
        module = self.init_stage(index)
        for view, (_, p) in zip(views(flat, plan), module.named_parameters()):
            view.copy_(p.detach())
        return flat

    def assemble(self) -> AssembledModel:
        """The whole network as one nn.Module with the initial weights."""
        stages = [self.init_stage(i) for i in range(self.num_layers)]
        return AssembledModel(self, stages)


class AssembledModel(nn.Module):
    """All layers resident: ``pre``, ``blocks``, ``post``. ``forward(batch, rng=(seed, step,
    micro_batch))`` seeds each layer exactly as the L2L executor does."""

    def __init__(self, layered: LayeredModel, stages: list[nn.Module]):
        super().__init__()
        self.dropout = float(getattr(layered.cfg, "dropout", 0.0))
        self.pre = stages[0]
        self.blocks = nn.ModuleList(stages[1:-1])
        self.post = stages[-1]

    def stages(self) -> list[nn.Module]:
        return [self.pre, *self.blocks, self.post]

    def forward(self, batch: Batch, rng: tuple[int, int, int] | None = None,
                checkpoint: bool = False):
        x = None
        device = batch.inputs.device
        stages = self.stages()
        for index, stage in enumerate(stages):
            enabled = rng is not None and self.training and self.dropout > 0
            seed = dropout_seed(rng[0], rng[1], index, rng[2]) if enabled else 0
            if checkpoint and 0 < index < len(stages) - 1:
                x = torch.utils.checkpoint.checkpoint(
                    _seeded_call, stage, x, batch, seed, device, enabled, use_reentrant=False)
            else:
                with seeded(seed, device, enabled):
                    x = stage(x, batch)
        return x


def _seeded_call(stage, x, batch, seed, device, enabled):
    with seeded(seed, device, enabled):
        return stage(x, batch)
