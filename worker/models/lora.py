"""LoRA (Hu et al., 2021) as PEFT makes it, on the blocks of a Hugging Face model
(``--lora-rank``): each targeted ``nn.Linear`` computes ``x W^T + b + s * B(A(dropout(x)))``
with ``s = alpha / r``, ``A`` (r x in) initialised kaiming-uniform (a = sqrt(5)) and ``B``
(out x r) zero, as PEFT's ``init_lora_weights=True`` does (``s = alpha / sqrt(r)`` with
rank-stabilised LoRA, PEFT's ``use_rslora``). DoRA (Liu et al., 2024; PEFT's ``use_dora``) adds
a trained magnitude ``m`` per output (``lora_magnitude_vector``, initialised to the norms of
W's rows) and computes ``m / ||W + s B A||_row * (W x + s B A x) + b``, the norm taken as a
constant as PEFT does; GPT-2's ``Conv1D`` (``x W + b``,
its weight in x out: PEFT's ``fan_in_fan_out``) gets the same update. The adapter's tensors are
the targeted module's ``lora_A.weight`` and ``lora_B.weight``: in a layer's manifest beside the
base weights, which are frozen (protocol/tensors.py "frozen"): the EPS holds the base model's
served copy only, and a master and optimizer state for the adapter and for the modules trained
whole (PEFT's ``modules_to_save``: a sequence classifier's head, by default, as PEFT's
SEQ_CLS task does).

A mixture of experts' stacked expert weights (``experts.gate_up_proj``, E x out x in) take
adapters as PEFT's ``target_parameters`` gives them (``apply_parameters``): ``lora_A`` (r*E x
in) and ``lora_B`` (out x r*E), expert e's update ``B_e A_e`` with ``A_e`` rows e*r..e*r+r-1
of A and ``B_e`` the columns e, E+e, ... of B, as PEFT reshapes them; where two parameters of
one module are adapted, the first one's adapter sits under ``base_layer.`` (PEFT nests its
wrappers in the parameters' order).

``adapter_files`` writes what ``PeftModel.from_pretrained(base, DIR)`` loads
(``adapter_config.json``, ``adapter_model.safetensors``: PEFT's names), ``merged`` folds the
adapter into the base weights (``W + s * B @ A``) for a plain model.
"""

from __future__ import annotations

import functools
import json
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from protocol.safetensors_io import write_safetensors
from protocol.tensors import LayerPlan

MAGNITUDE = ".lora_magnitude_vector"  # DoRA's (PEFT's name, as it saves it)
ADAPTER = (".lora_A.weight", ".lora_B.weight", MAGNITUDE)
# "auto" targets: PEFT's defaults (its TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING) for
# these model types, q_proj,v_proj for the others (PEFT's own for Llama, Mistral, Qwen, Gemma;
# its choice for OLMo 2, SmolLM3, Granite, where PEFT has none), Phi-3's and GPT-NeoX's fused
# projections, and Phi's (its attention's and MLP's).
AUTO_TARGETS = {"bert": "query,value", "roberta": "query,value", "xlm-roberta": "query,value",
                "gpt2": "c_attn", "phi3": "qkv_proj", "phi": "q_proj,v_proj,fc1,fc2",
                "gpt_neox": "query_key_value"}
# "auto" modules trained whole: PEFT's for a sequence classifier (SEQ_CLS), none for an LM
CLASSIFIER_HEADS = ("classifier", "score")


def is_adapter(tensor: str) -> bool:
    return tensor.endswith(ADAPTER)


def adapted(tensor: str) -> str:
    """The module an adapter's tensor belongs to (``a.q_proj.lora_A.weight``: ``a.q_proj``)."""
    return next(tensor[:-len(end)] for end in ADAPTER if tensor.endswith(end))


def _update(self, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """What the adapter adds to the base layer's ``result`` (its output for ``x``)."""
    if not hasattr(self, "lora_magnitude_vector"):
        return self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
    # DoRA, as PEFT computes it (its DoraLinearLayer): the base output reused unless dropout
    # changes the adapters' input; B A's norm taken as a constant (the paper's section 4.3)
    w = self.weight.T if self.fan_in_fan_out else self.weight  # out x in
    if isinstance(self.lora_dropout, nn.Identity) or not self.training:
        base = result if self.bias is None else result - self.bias
    else:
        x = self.lora_dropout(x)
        base = F.linear(x, w)
    m = self.lora_magnitude_vector
    with torch.no_grad():  # in fp32, then as m is served: m / norm is 1 where m was made
        delta = (self.lora_B.weight @ self.lora_A.weight).float()
        norm = torch.linalg.norm(w.float() + self.scaling * delta, dim=1).to(m.dtype)
    scale = (m / norm).view(1, -1).to(x.dtype)
    return (scale - 1) * base + scale * self.lora_B(self.lora_A(x)) * self.scaling


class LoraLinear(nn.Linear):
    """An ``nn.Linear`` with a LoRA update (its class is swapped in by ``apply``)."""

    fan_in_fan_out = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = F.linear(x, self.weight, self.bias)
        return result + _update(self, x, result)


def _conv1d():
    from transformers.pytorch_utils import Conv1D

    return Conv1D


@functools.cache
def _lora_conv1d(conv1d):
    class LoraConv1D(conv1d):
        """GPT-2's ``Conv1D`` (weight in x out) with a LoRA update."""

        fan_in_fan_out = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            result = super().forward(x)
            return result + _update(self, x, result)

    return LoraConv1D


def scaling(alpha: float, rank: int, rslora: bool = False) -> float:
    """The update's scale: alpha / r, or alpha / sqrt(r) for rank-stabilised LoRA (PEFT's)."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def names(spec: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in spec.split(",") if t.strip())


def targets(spec: str, model_type: str = "") -> tuple[str, ...] | None:
    """``--lora-targets``: module names (the last part of a qualified name), None for every
    linear layer of the blocks ("all-linear"), or "auto": PEFT's default for ``model_type``."""
    spec = spec.strip()
    if spec == "all-linear":
        return None
    if spec == "none":
        return ()
    if spec == "auto":
        spec = AUTO_TARGETS.get(model_type, "q_proj,v_proj")
    return names(spec)


def targeted(module: nn.Module, spec: str, model_type: str = "") -> list[str]:
    """The names of the linear layers of ``module`` (one stage) --lora-targets ``spec``
    adapts."""
    want, conv1d = targets(spec, model_type), _conv1d()
    return [n for n, m in module.named_modules() if type(m) in (nn.Linear, conv1d) and
            (want is None or n.rpartition(".")[2] in want)
            and m.weight.requires_grad]  # (not a linear the library never trains: frozen)


def apply(module: nn.Module, rank: int, scale: float, spec: str, dropout: float,
          model_type: str = "", dora: bool = False,
          only: dict[str, tuple[int, float]] | None = None) -> dict[str, bool]:
    """Add LoRA (rank ``rank``, its update scaled by ``scale``; ``dora``: DoRA's magnitudes,
    given their values by the loader) to the targeted linear layers of ``module`` (one stage),
    or to those ``only`` names, each with its (rank, scale): their last names, each with
    whether it is a ``Conv1D`` (weight in x out)."""
    conv1d = _conv1d()
    names = targeted(module, spec, model_type)
    shapes = {n: (rank, scale) for n in names} if only is None else {
        n: only[n] for n in names if n in only}
    found = [(n, module.get_submodule(n)) for n in shapes]
    kinds = {n.rpartition(".")[2]: type(m) is conv1d for n, m in found}
    for name, lin in found:
        transposed = type(lin) is conv1d
        fan_in, fan_out = lin.weight.shape if transposed else lin.weight.shape[::-1]
        kw = {"device": lin.weight.device, "dtype": lin.weight.dtype}
        r, lin.scaling = shapes[name]
        lin.lora_A = nn.Linear(fan_in, r, bias=False, **kw)
        lin.lora_B = nn.Linear(r, fan_out, bias=False, **kw)
        lin.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        if dora:
            lin.lora_magnitude_vector = nn.Parameter(torch.ones(fan_out, **kw))
        lin.__class__ = _lora_conv1d(conv1d) if transposed else LoraLinear
    return kinds


def expert_delta(a: torch.Tensor, b: torch.Tensor, experts: int,
                 transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The low-rank factors (lhs, rhs) of a stacked parameter's update, lhs @ rhs per expert,
    from its adapter's A (r*E x in) and B (out x r*E), as PEFT's ParamWrapper reshapes them:
    an (E, out, in) stack's update is B_e A_e; a transposed (E, in, out) one's A_e^T B_e^T."""
    rhs = a.reshape(experts, -1, a.shape[-1])  # E x r x in
    lhs = b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)  # E x out x r
    return (rhs.transpose(-2, -1), lhs.transpose(-2, -1)) if transposed else (lhs, rhs)


class _LoraExperts:
    """Mixed into an experts module whose stacked parameters have adapters: reading such a
    parameter gives W + s * lhs @ rhs (one baddbmm in W's dtype, as PEFT folds it), computed
    once per forward (the library's eager experts read a stack once per expert)."""

    def _adapted(self, name: str) -> torch.Tensor:
        cache = self.__dict__.get("_lora_cache")
        if cache is not None and name in cache:
            return cache[name]
        w = self._parameters[name]
        holder = self.get_submodule(self._lora_holders[name])
        lhs, rhs = expert_delta(holder.lora_A.weight, holder.lora_B.weight, w.shape[0],
                                getattr(self, "is_transposed", False))
        with torch.autocast(device_type=w.device.type, enabled=False):
            out = torch.baddbmm(w, lhs.to(w.dtype), rhs.to(w.dtype), alpha=self.scaling)
        if cache is not None:
            cache[name] = out
        return out

    def forward(self, *args, **kwargs):
        self._lora_cache = {}
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._lora_cache = None


@functools.cache
def _lora_experts(base: type, params: tuple[str, ...]) -> type:
    props = {p: property(functools.partial(lambda self, p: self._adapted(p), p=p))
             for p in params}
    return type(f"Lora{base.__name__}", (_LoraExperts, base), props)


def apply_parameters(module: nn.Module, rank: int, scale: float,
                     spec: str) -> dict[str, tuple[str, bool]]:
    """Add LoRA to the stacked (3-D) parameters of ``module`` (one stage) whose qualified name
    is, or ends with ".", one of ``spec``'s (PEFT's ``target_parameters`` rule): their
    adapters' module names, each with the parameter it adapts and whether the stack is
    transposed (E x in x out)."""
    want, out = names(spec), {}
    for owner_name, owner in list(module.named_modules()):
        prefix = owner_name + "." if owner_name else ""
        params = [(n, p) for n, p in owner.named_parameters(recurse=False)
                  if any(prefix + n == w or (prefix + n).endswith("." + w) for w in want)]
        if not params:
            continue
        flat = [prefix + n for n, p in params if p.dim() != 3]
        if flat:
            raise ValueError(f"--lora-target-parameters matches {flat[0]}, which is not a "
                             "stack of experts (3-D); adapt linear layers with --lora-targets")
        transposed = bool(getattr(owner, "is_transposed", False))
        owner._lora_holders = {}
        for depth, (name, p) in enumerate(reversed(params)):  # the last one outermost
            holder = owner
            for _ in range(depth):
                if not hasattr(holder, "base_layer"):
                    holder.base_layer = nn.Module()
                holder = holder.base_layer
            experts, d1, d2 = p.shape
            fan_in, fan_out = (d1, d2) if transposed else (d2, d1)
            kw = {"device": p.device, "dtype": p.dtype}
            holder.lora_A = nn.Linear(fan_in, rank * experts, bias=False, **kw)
            holder.lora_B = nn.Linear(rank * experts, fan_out, bias=False, **kw)
            path = ".".join(["base_layer"] * depth)
            owner._lora_holders[name] = path
            out[".".join(x for x in (owner_name, path) if x)] = (prefix + name, transposed)
        owner.scaling = scale
        owner.__class__ = _lora_experts(type(owner), tuple(n for n, _ in params))
    return out


def modules_to_save(spec: str, classifies: bool) -> tuple[str, ...]:
    """``--lora-modules-to-save``: the names of modules trained whole beside the adapters
    ("auto": a sequence classifier's head, as PEFT's SEQ_CLS; "none": nothing)."""
    spec = spec.strip()
    if spec == "auto":
        return CLASSIFIER_HEADS if classifies else ()
    if spec == "none":
        return ()
    return tuple(t.strip() for t in spec.split(",") if t.strip())


def saved(hf_name: str, modules: tuple[str, ...]) -> bool:
    """Whether the checkpoint tensor ``hf_name`` lies in one of ``modules``: in a module whose
    qualified name ends with one of the names (PEFT's rule: "norm" is every norm)."""
    parts = hf_name.split(".")[:-1]
    paths = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(p.endswith(m) for p in paths for m in modules)


class LoraInit:
    """A weight loader: the base model's tensors from ``base`` (the checkpoint), the adapter's
    initialised as PEFT does, seeded by (seed, layer, tensor); DoRA's magnitudes are the norms
    of the base weight's rows (``fan_in_fan_out``: of its columns, a ``Conv1D``'s outputs), of
    the weight as it is served (``served``: bf16 compute, say) and rounded as they will be, so
    that the adapted layer starts as the base layer, as in PEFT."""

    served = torch.float32

    def __init__(self, base, seed: int, fan_in_fan_out: bool = False):
        self.base, self.seed, self.fan_in_fan_out = base, seed, fan_in_fan_out

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
            elif s.name.endswith(MAGNITUDE):  # ||W + s B A|| with B = 0, as _update takes it
                w = out[adapted(s.name) + ".weight"].to(self.served).float()
                norm = torch.linalg.norm(w.T if self.fan_in_fan_out else w, dim=1)
                out[s.name] = norm.to(self.served).float()
        return out


def adapter_files(path: str, named: dict[str, torch.Tensor], config: dict,
                  dtype: torch.dtype | None = None) -> None:
    """PEFT's adapter directory: ``named`` maps PEFT's names (``base_model.model.`` and the
    library's) to the adapter's tensors (written in ``dtype``)."""
    if os.path.isdir(path) and os.listdir(path) and not os.path.isfile(
            os.path.join(path, "adapter_config.json")):
        raise ValueError(f"{path} is a non-empty directory that is not an adapter; not "
                         "writing into it")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    write_safetensors(os.path.join(path, "adapter_model.safetensors"),
                      [(n, t.contiguous()) for n, t in named.items()],
                      {"format": "pt"}, dtype=dtype)


def merged(tensors: dict[tuple[str, str], torch.Tensor], scaling: float,
           fan_in_fan_out: bool = False, stacked: dict | None = None,
           scales: dict[tuple[str, str], float] | None = None) -> dict:
    """The base weights with each adapter folded in (W + s * B @ A; with DoRA's magnitude m,
    m / ||W + s B A||_row * (W + s B A); a ``Conv1D``'s weight, ``fan_in_fan_out``, is
    transposed to that and back; ``scales``: s of some (layer, module)), the adapter left
    out: ``tensors`` in place, each base weight let go as its merged value replaces it."""
    adapters = {k: tensors.pop(k) for k in [k for k in tensors if is_adapter(k[1])]}
    for (layer, name), a in adapters.items():
        if name.endswith(".lora_A.weight"):
            prefix = adapted(name)
            b = adapters[layer, prefix + ".lora_B.weight"]
            if prefix in (stacked or {}):  # an expert stack's (apply_parameters)
                param, transposed = stacked[prefix]
                lhs, rhs = expert_delta(a, b, tensors[layer, param].shape[0], transposed)
                tensors[layer, param] = torch.baddbmm(tensors[layer, param], lhs, rhs,
                                                      alpha=scaling)
                continue
            w = tensors[layer, prefix + ".weight"]
            s = (scales or {}).get((layer, prefix), scaling)  # (a module's own alpha and rank)
            w = (w.T if fan_in_fan_out else w) + s * (b @ a)
            magnitude = adapters.get((layer, prefix + MAGNITUDE))
            if magnitude is not None:
                w = (magnitude / torch.linalg.norm(w, dim=1)).view(-1, 1) * w
            tensors[layer, prefix + ".weight"] = w.T if fan_in_fan_out else w
    return tensors
