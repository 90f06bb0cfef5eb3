"""Mixture-of-experts layers in checkpoints, one layer at a time.

The library keeps a MoE layer's experts as two stacked tensors, ``mlp.experts.gate_up_proj``
(experts x 2*intermediate x hidden: each expert's gate rows, then its up rows) and
``mlp.experts.down_proj`` (experts x hidden x intermediate), while checkpoints, and what
``save_pretrained`` writes, keep one Linear per expert: Mixtral's
``block_sparse_moe.experts.E.w1/w3/w2`` (gate, up, down; its router under
``block_sparse_moe.gate``), Qwen-MoE's and OLMoE's ``mlp.experts.E.gate_proj/up_proj/down_proj``.
This is the library's conversion mapping (transformers/conversion_mapping.py) for these types,
applied as it loads and reversed as it saves; a checkpoint already in the stacked form is read
as it is. gpt-oss's checkpoints keep the library's stacks (``STACKED``: experts x hidden x
2*intermediate, gate and up interleaved, with biases), read and written as they are, as do
Mistral 4's; GraniteMoE's keep them under names of their own, as ERNIE 4.5, K-EXAONE and
Hunyuan 3 their routing biases, PhiMoE its router and MiMo-V2-Flash its attention sinks
(``renames``); Kimi Linear keeps its q/k/v convolutions apart (``joins``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

GATE_UP, DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


@dataclass(frozen=True)
class ExpertNames:
    module: str  # the MoE block's name in checkpoints (the library's is "mlp")
    gate: str
    up: str
    down: str
    per_expert: bool = True  # False: checkpoints keep the library's stacks (gpt-oss)
    # (the library's, the checkpoint's) parts of names that differ, the tensor the same:
    # GraniteMoE's stacks and router, ERNIE 4.5's routing bias
    renames: tuple[tuple[str, str], ...] = ()
    # (the library's tensor, the checkpoint's it concatenates along dim 0, equal in size):
    # Kimi Linear's q/k/v convolutions, one in the library
    joins: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def _joined(self, name: str) -> tuple[str, tuple[str, ...]] | None:
        for ours, theirs in self.joins:
            if name.endswith(ours):
                prefix = name[:-len(ours)]
                return prefix, tuple(prefix + t for t in theirs)
        return None

    def _renamed(self, name: str, back: bool = False) -> str | None:
        for ours, theirs in self.renames:
            old, new = (theirs, ours) if back else (ours, theirs)
            if old in name:
                return name.replace(old, new, 1)
        return None

    def _expert(self, prefix: str, e: int, proj: str) -> str:
        return f"{prefix}{self.module}.experts.{e}.{proj}.weight"

    def read(self, name: str, shape: tuple, get: Callable[[str], torch.Tensor | None]
             ) -> torch.Tensor | None:
        """The library's tensor ``name`` (``shape``) from a checkpoint's per-expert tensors
        (``get``: a checkpoint tensor by name, None if absent); None if it has none."""
        if (renamed := self._renamed(name)) is not None:
            return get(renamed)
        if (joined := self._joined(name)) is not None:
            parts = [get(t) for t in joined[1]]
            return None if any(t is None for t in parts) else torch.cat(parts, 0)
        if not self.per_expert:
            return None
        if name.endswith((GATE_UP, DOWN)):
            stacked = GATE_UP if name.endswith(GATE_UP) else DOWN
            prefix = name[:-len(stacked)]
            parts = (self.gate, self.up) if stacked == GATE_UP else (self.down,)
            experts = []
            for e in range(shape[0]):
                found = [get(self._expert(prefix, e, p)) for p in parts]
                if any(t is None for t in found):
                    return None
                experts.append(torch.cat(found, 0) if len(found) > 1 else found[0])
            return torch.stack(experts)
        if self.module != "mlp" and ".mlp." in name:  # Mixtral's router
            return get(name.replace(".mlp.", f".{self.module}.", 1))
        return None

    def write(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors for the library's tensor ``name`` (as save_pretrained
        writes them)."""
        if (renamed := self._renamed(name)) is not None:
            return [(renamed, t)]
        if (joined := self._joined(name)) is not None:
            return list(zip(joined[1], (p.contiguous() for p in t.chunk(len(joined[1]), 0))))
        if not self.per_expert:
            return [(name, t)]
        if name.endswith(GATE_UP):
            prefix, half = name[:-len(GATE_UP)], t.shape[1] // 2
            return [pair for e in range(t.shape[0]) for pair in (
                (self._expert(prefix, e, self.gate), t[e, :half].contiguous()),
                (self._expert(prefix, e, self.up), t[e, half:].contiguous()))]
        if name.endswith(DOWN):
            prefix = name[:-len(DOWN)]
            return [(self._expert(prefix, e, self.down), t[e].contiguous())
                    for e in range(t.shape[0])]
        if self.module != "mlp" and ".mlp." in name:
            return [(name.replace(".mlp.", f".{self.module}.", 1), t)]
        return [(name, t)]


MIXTRAL = ExpertNames("block_sparse_moe", "w1", "w3", "w2")
QWEN = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")
STACKED = ExpertNames("mlp", "", "", "", per_expert=False)
ERNIE = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj", renames=(
    ("mlp.gate.moe_statics.", "mlp.moe_statics."),))
EXAONE = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj", renames=(
    ("mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias"),))
HUNYUAN3 = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj", renames=(
    ("mlp.e_score_correction_bias", "mlp.expert_bias"),
    ("mlp.gate.weight", "mlp.router.gate.weight"), ("mlp.shared_experts.", "mlp.shared_mlp.")))
MIMO = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj", renames=(
    ("self_attn.sinks", "self_attn.attention_sink_bias"),))  # (not an expert's: its attention)
PHIMOE = ExpertNames("block_sparse_moe", "w1", "w3", "w2", renames=(
    ("mlp.router.weight", "block_sparse_moe.gate.weight"),))
KIMI = ExpertNames("block_sparse_moe", "w1", "w3", "w2", renames=(
    ("self_attn.forget_gate.", "self_attn."),), joins=(
    ("self_attn.conv1d.weight", ("self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight",
                                 "self_attn.v_conv1d.weight")),))
GRANITE = ExpertNames("block_sparse_moe", "", "", "", per_expert=False, renames=(
    ("block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.input_linear.weight"),
    ("block_sparse_moe.experts.down_proj", "block_sparse_moe.output_linear.weight"),
    ("block_sparse_moe.router.weight", "block_sparse_moe.router.layer.weight")))


def sparse_layers(config) -> list[bool]:
    """Which layers are MoE: Qwen-MoE's dense layers are those ``mlp_only_layers`` lists and
    those ``decoder_sparse_step`` skips, DeepSeek-V3's and GLM-4.5's the first
    ``first_k_dense_replace``, ERNIE 4.5's those outside its start, end and interval, Llama
    4's those ``moe_layers`` does not list, and where a config lists ``mlp_layer_types``, its
    "dense" ones (the library's rules); the others' layers all are."""
    n = config.num_hidden_layers
    types = getattr(config, "mlp_layer_types", None)  # (the newer configs say it per layer)
    if types is not None:
        return [t != "dense" for t in types[:n]]
    dense = getattr(config, "num_dense_layers", None)  # AFMoE: the first ones
    if dense is not None:
        return [i >= dense for i in range(n)]
    listed = getattr(config, "moe_layers", None)  # Llama 4
    if listed is not None:
        return [i in listed for i in range(n)]
    start = getattr(config, "moe_layer_start_index", None)  # ERNIE 4.5
    if start is not None:
        end = n - 1 if config.moe_layer_end_index == -1 else config.moe_layer_end_index
        return [(i + 1) % config.moe_layer_interval == 0 and start <= i <= end
                for i in range(n)]
    first = getattr(config, "first_k_dense_replace", None)
    if first is not None:
        return [i >= first for i in range(n)]
    only = getattr(config, "mlp_only_layers", None)
    if only is None:
        return [True] * n
    step = config.decoder_sparse_step
    return [i not in only and config.num_experts > 0 and (i + 1) % step == 0 for i in range(n)]
