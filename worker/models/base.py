"""The model contract: what the L2L loop needs to know about a layered network.

A ``LayeredModel`` is ``pre`` -> blocks -> ``post`` (any number of layers, at least two):
- ``layer_kinds()``: (layer name, stage kind) in execution order; every layer of a kind has the
  same tensors. Layer names are the prefixes of the assembled module's parameter names.
- ``make_stage(kind)``: a module computing ``stage(x, batch) -> x``. ``x`` is the boundary
  activation: None into ``pre``, then a tensor or a tuple of tensors; what a stage needs besides
  (masks, positions) it derives from ``batch``, the micro-batch, on every call. ``post`` returns
  ``(loss, correct)``: the micro-batch's loss already divided by the *global* minibatch's
  normaliser, and its count of correct predictions.
- ``ties()``: tensors one layer reads from an earlier one (e.g. an LM head tied to the token
  embedding); the manifest records them, the EPS stores and updates each once.
- ``loader()``: initial weights, one layer at a time (loaders.py): a seeded random init, or a
  safetensors file of the assembled model.
- ``objective``: what ``post`` is trained on ("classify" or "lm"), which a task must produce.

The worker keeps one weightless template module per stage kind and binds it *by name* to a
layer's weights for each visit (``Binder``); the same network as an ordinary ``nn.Module``
(``assemble``) is the baseline and the export format.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn
from torch.overrides import TorchFunctionMode

from protocol.tensors import LayerPlan, LayerSpec, Manifest, TensorSpec, plan_layout


@dataclass(frozen=True)
class Batch:
    """One micro-batch. ``norm`` is the number of loss terms in the whole global minibatch."""

    inputs: torch.Tensor  # (B, T) int64 token ids
    targets: torch.Tensor  # (B,) class ids or (B, T) next-token ids (-100: no target)
    norm: float
    mask: torch.Tensor | None = None  # (B, T) 1 for real tokens, 0 for padding; None: no padding
    token_types: torch.Tensor | None = None  # (B, T) segment ids of sentence pairs (BERT)

    def to(self, device: torch.device) -> Batch:
        def move(t):
            return None if t is None else t.to(device, non_blocking=True)

        return Batch(move(self.inputs), move(self.targets), self.norm, move(self.mask),
                     move(self.token_types))


SAVE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def save_dtype(cfg, own: torch.dtype | str | None = None) -> torch.dtype:
    """The dtype --save writes (``cfg.save_dtype``; auto: ``own``, a source's, else fp32)."""
    name = getattr(cfg, "save_dtype", "fp32")
    if name != "auto":
        return SAVE_DTYPES[name]
    own = getattr(torch, own, None) if isinstance(own, str) else own
    return own if own in SAVE_DTYPES.values() else torch.float32


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


class Freezer:
    """--freeze: which tensors are frozen (globs over "<layer>.<tensor>"; a tied tensor as its
    owner), and a clear error for a pattern that matches nothing or leaves nothing to train."""

    def __init__(self, patterns: str, trains=None):
        self.patterns = [p.strip() for p in patterns.split(",") if p.strip()]
        self.used: set[str] = set()
        self.trains = trains  # LoRA: trains(layer, tensor), the only tensors that train

    def frozen(self, layer: str, tensor: str) -> bool:
        hits = [p for p in self.patterns if fnmatch.fnmatchcase(f"{layer}.{tensor}", p)]
        self.used.update(hits)
        return bool(hits)

    def group(self, layer: str, tensor: str, tie, group: str) -> str:
        owner = tie if tie is not None else (layer, tensor)
        base = self.trains is not None and not self.trains(*owner)
        return "frozen" if self.frozen(*owner) or base else group

    def check(self, layers) -> None:
        unused = [p for p in self.patterns if p not in self.used]
        if unused:
            some = ", ".join(f"{la.name}.{t.name}" for la in layers[:2] for t in la.tensors[:2])
            raise ValueError(f"--freeze {unused[0]!r} matches no tensor (names look like "
                             f"{some}; l2l-launch --plan lists them)")
        if self.patterns and all(t.group == "frozen" for la in layers for t in la.tensors):
            raise ValueError("--freeze leaves nothing to train")


def optimizer_groups(named_parameters, weight_decay: float) -> list[dict]:
    """torch optimizer parameter groups as the EPS's per-layer optimizers have them: weight
    decay for matrices only (the reference every resident baseline and peer trains with)."""
    groups: dict[str, list] = {"decay": [], "no_decay": []}
    for name, p in named_parameters:
        groups[param_group(name, p)].append(p)
    return [{"params": groups["decay"], "weight_decay": weight_decay},
            {"params": groups["no_decay"], "weight_decay": 0.0}]


# In-place writes of values an initialiser makes (besides all of torch.nn.init).
_VALUE_WRITES = frozenset({"normal_", "uniform_", "zero_", "fill_", "copy_", "erfinv_", "mul_",
                           "add_", "sub_", "div_", "clamp_", "exponential_", "random_",
                           "bernoulli_", "log_normal_", "cauchy_", "geometric_"})


class SkipInitOnMeta(TorchFunctionMode):
    """Skips initialisers on meta tensors: they compute nothing there, but torch runs some
    (``normal_``, ``uniform_``) through Python references whose first use imports
    torch._dynamo, 2-3 s of CPU in every process that builds a manifest or a template."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes keywords
        if (isinstance(target, torch.Tensor) and target.is_meta
                and (getattr(func, "__module__", None) == "torch.nn.init"
                     or getattr(func, "__name__", None) in _VALUE_WRITES)):
            return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Build modules whose parameters are moved to the meta device as they are registered
    (their initialisers then run on meta: nothing is computed), while buffers are computed for
    real: what ``accelerate.init_empty_weights(include_buffers=False)`` does."""
    register = nn.Module.register_parameter

    def to_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = to_meta
    try:
        with SkipInitOnMeta():
            yield
    finally:
        nn.Module.register_parameter = register


class Binder:
    """Binds one template module (per stage kind, holding no weights of its own) to a layer's
    weights for one visit, by parameter name: each parameter slot is pointed at the tensor of
    that name (a view of the layer's flat buffer, or a tied tensor). This is what
    ``torch.func.functional_call`` does on every call, done once per visit: the visit's
    micro-batches then run the plain module."""

    def __init__(self, module: nn.Module):
        self.module = module
        self._slots: dict[str, tuple[nn.Module, str]] = {}
        for name, _ in module.named_parameters():
            owner_name, _, attr = name.rpartition(".")
            self._slots[name] = (module.get_submodule(owner_name), attr)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._slots)

    def bind(self, tensors: Mapping[str, torch.Tensor]) -> nn.Module:
        if tensors.keys() != self._slots.keys():
            missing = sorted(set(self._slots) - set(tensors))
            extra = sorted(set(tensors) - set(self._slots))
            raise ValueError(f"cannot bind {type(self.module).__name__}: missing {missing}, "
                             f"unexpected {extra}")
        for name, t in tensors.items():
            owner, attr = self._slots[name]
            owner._parameters[attr] = t  # plain tensor, not a Parameter: a view of the layer
        return self.module


class LayeredModel:
    """Base class of the built-in models and of your own (``--model package.module:Class``)."""

    name = "base"
    objective = "classify"  # what post trains on: "classify" (labels) or "lm" (next tokens)
    default_task = "trigger"  # the task --task auto picks

    def __init__(self, cfg):
        self.cfg = cfg
        self.dropout = float(getattr(cfg, "dropout", 0.0))  # > 0: masks are seeded per layer
        self._loader = None

    # -- to be provided by subclasses -------------------------------------------------------

    def make_stage(self, kind: str) -> nn.Module:
        raise NotImplementedError

    def layer_kinds(self) -> list[tuple[str, str]]:
        raise NotImplementedError

    def meta(self) -> dict[str, str | int | float | bool]:
        """Architecture facts that must agree between workers (part of the manifest hash)."""
        raise NotImplementedError

    def ties(self) -> dict[tuple[str, str], tuple[str, str]]:
        """{(layer, tensor): (earlier layer, its tensor)}: tensors read from another layer."""
        return {}

    def pad_id(self, tokenizer) -> int:
        """The id text is padded with (for a model with a tokenizer): the tokenizer's, else 0
        (the attention mask leaves it out)."""
        return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    # -- derived ------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds())

    def manifest(self) -> Manifest:
        layers, ties = [], self.ties()
        cfg = self.cfg
        frozen = Freezer(getattr(cfg, "freeze", ""), self.lora_trains())
        for name, kind in self.layer_kinds():
            with torch.device("meta"), SkipInitOnMeta():
                module = self.make_stage(kind)
            layers.append(LayerSpec(name=name, kind=kind, tensors=tuple(
                TensorSpec(name=n, shape=tuple(p.shape), tie=ties.get((name, n)),
                           group=frozen.group(name, n, ties.get((name, n)), param_group(
                               n, p) if p.requires_grad else "frozen"))  # (buffer: frozen)
                for n, p in module.named_parameters())))
        frozen.check(layers)
        return Manifest(layers=tuple(layers), meta=self.meta())

    def lora_trains(self):
        """With LoRA, ``trains(layer, tensor)``: whether a tensor trains (the rest is the frozen
        base model); None without."""
        return None

    def exported(self, plan: LayerPlan) -> list[str]:
        """The layer's tensors ``export`` writes (all; a LoRA adapter: its own)."""
        return [s.name for s in plan.tensors]

    def template(self, kind: str, device: torch.device | str = "cpu") -> Binder:
        """A module of ``kind`` whose parameters live on the meta device (no memory; they are
        bound to a layer's weights on each visit) and whose buffers (e.g. rotary frequencies)
        are real, on ``device``."""
        with params_on_meta():
            module = self.make_stage(kind)
        for sub in module.modules():
            for name, buf in sub._buffers.items():
                if buf is not None:
                    sub._buffers[name] = buf.to(device)
        return Binder(module)

    def init_stage(self, index: int) -> nn.Module:
        """Layer ``index`` as a module holding its random initial weights (a pure function of
        the seed and the index, so a worker can make layer l without the others)."""
        _, kind = self.layer_kinds()[index]
        module = self.make_stage(kind)
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed, "init", index))
        init_params(module, gen)
        return module

    def loader(self, served: torch.dtype = torch.float32):
        """Where the initial weights come from: ``cfg.init_from`` or the seeded random init
        (``served``: the dtype the EPS serves them in, for values computed from others)."""
        from .loaders import RandomInit, SafetensorsInit

        if self._loader is None:
            path = getattr(self.cfg, "init_from", "")
            self._loader = SafetensorsInit(path) if path else RandomInit(self)
        return self._loader

    def drop_loader(self) -> None:
        self._loader = None

    def init_flat(self, index: int, plan: LayerPlan) -> torch.Tensor:
        """Initial weights of layer ``index`` in its flat fp32 layout (padding zero)."""
        from .loaders import flat_of

        assert plan.index == index
        return flat_of(self.loader(), plan)

    def export(self, path: str, tensors: dict[tuple[str, str], torch.Tensor],
               metadata: dict) -> None:
        """Write trained weights ((layer, tensor) -> value, each layer's own) as the assembled
        module's state dict (safetensors; a tied tensor under each of its names)."""
        from protocol.safetensors_io import write_safetensors

        named = {f"{layer}.{name}": t for (layer, name), t in tensors.items()}
        for (reader, name), (owner, source) in self.ties().items():
            named[f"{reader}.{name}"] = tensors[owner, source]
        write_safetensors(path, list(named.items()), metadata, dtype=save_dtype(self.cfg))

    def assemble(self) -> AssembledModel:
        """The whole network as one nn.Module with the initial weights (tied tensors shared)."""
        stages = []
        for plan in plan_layout(self.manifest()).layers:
            module = self.make_stage(plan.kind)
            values = self.loader().load(plan)
            with torch.no_grad():
                for n, p in module.named_parameters():
                    if n in values:
                        p.copy_(values[n])
            stages.append(module)
        names = [n for n, _ in self.layer_kinds()]
        for (reader, tensor), (owner, source) in self.ties().items():
            shared = stages[names.index(owner)].get_parameter(source)
            sub, _, attr = tensor.rpartition(".")
            stages[names.index(reader)].get_submodule(sub)._parameters[attr] = shared
        for stage, layer in zip(stages, self.manifest().layers):  # --freeze: no gradient
            for t in layer.tensors:
                if t.group == "frozen" and t.tie is None:  # (_parameters: a LoRA'd expert
                    sub, _, attr = t.name.rpartition(".")  # stack's attribute is a property)
                    stage.get_submodule(sub)._parameters[attr].requires_grad_(False)
        return AssembledModel(self, stages)


class AssembledModel(nn.Module):
    """All layers resident: ``pre``, ``blocks``, ``post``. ``forward(batch, rng=(seed, step,
    micro_batch))`` seeds each layer exactly as the L2L executor does."""

    def __init__(self, layered: LayeredModel, stages: list[nn.Module]):
        super().__init__()
        self.dropout = layered.dropout
        self.pre = stages[0]
        self.blocks = nn.ModuleList(stages[1:-1])
        self.post = stages[-1]

    def stages(self) -> list[nn.Module]:
        return [self.pre, *self.blocks, self.post]

    def forward(self, batch: Batch, rng: tuple[int, int, int] | None = None,
                checkpoint: bool = False, skip: frozenset[int] = frozenset()):
        """``skip``: layer indices that pass their input through (LayerDrop)."""
        x = None
        device = batch.inputs.device
        stages = self.stages()
        for index, stage in enumerate(stages):
            if index in skip:
                continue
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
