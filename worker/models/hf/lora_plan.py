"""Which linear layers of each block LoRA adapts, at which rank and alpha, as PEFT decides it:
--lora-targets, then --lora-layers (PEFT's layers_to_transform), --lora-exclude-modules
(exclude_modules: a module whose PEFT name is one of them, or ends with "." and one) and
--lora-rank-pattern / --lora-alpha-pattern (rank_pattern, alpha_pattern: the first pattern
that matches a module's PEFT name whole, or from just after a ".", gives its value).

Blocks whose adapters are alike share a stage kind: the block's own kind where every target
has --lora-rank and --lora-alpha, ``<kind>-plain`` where none is adapted, and
``<kind>-lora<j>`` for the j-th other set of {module: (rank, alpha)}.
"""

from __future__ import annotations

import logging
import re

import torch

from ...spelled import lora_layers, patterns
from .. import lora
from ..base import SkipInitOnMeta
from . import families

log = logging.getLogger("l2l_worker")

PLAIN, VARIANT = "-plain", "-lora"
Spec = dict[str, tuple[int, float]]  # an adapted module (its name in the stage): (rank, alpha)


def _first(keys, name: str):
    """PEFT's get_pattern_key: the first pattern a match of which ends ``name``."""
    return next((k for k in keys if re.match(rf"(.*\.)?({k})$", name)), None)


class LoraPlan:
    def __init__(self, model):
        cfg = model.cfg
        self.rank, self.alpha, self.rslora = cfg.lora_rank, cfg.lora_alpha, cfg.lora_rslora
        self.ranks = patterns(cfg.lora_rank_pattern, "--lora-rank-pattern", True)
        self.alphas = patterns(cfg.lora_alpha_pattern, "--lora-alpha-pattern", False)
        self.excluded = excluded = lora.names(cfg.lora_exclude_modules)
        layers = lora_layers(cfg.lora_layers)
        self.kinds: list[str] = []  # each block's
        self.variants: list[Spec] = []
        names: dict[str, list[str]] = {}  # base kind -> the modules --lora-targets adapts
        used: set[str] = set()  # patterns and exclusions that match some module
        for i, kind in enumerate(model._kinds):
            if kind not in names:
                with torch.device("meta"), SkipInitOnMeta():
                    stage = families.make_stage(model.config, model.family, kind)
                names[kind] = lora.targeted(stage, cfg.lora_targets, model.config.model_type)
            spec: Spec = {}
            for n in names[kind] if not layers or i in layers else ():
                full = model.adapter_name(f"blocks.{i}", n + ".weight")[
                    len("base_model.model."):-len(".weight")]
                out = {e for e in excluded if full == e or full.endswith("." + e)}
                used |= out | {k for k in (*self.ranks, *self.alphas) if _first((k,), full)}
                if out:
                    continue
                r, a = _first(self.ranks, full), _first(self.alphas, full)
                spec[n] = (int(self.ranks[r]) if r is not None else self.rank,
                           self.alphas[a] if a is not None else self.alpha)
            if spec == {n: (self.rank, self.alpha) for n in names[kind]}:
                self.kinds.append(kind)
            elif not spec:
                self.kinds.append(kind + PLAIN)
            else:
                if spec not in self.variants:
                    self.variants.append(spec)
                self.kinds.append(f"{kind}{VARIANT}{self.variants.index(spec)}")
        unused = [k for k in (*excluded, *self.ranks, *self.alphas) if k not in used]
        if unused:  # (as PEFT warns)
            log.warning("LoRA: %s matches no module --lora-targets adapts (a pattern matches "
                        "a name whole, or from just after a '.')", ", ".join(map(repr, unused)))

    def of(self, kind: str) -> tuple[str, dict[str, tuple[int, float]] | None]:
        """A stage kind's base kind, and its adapted modules with (rank, scale) (None: every
        target, at --lora-rank and --lora-alpha)."""
        if kind.endswith(PLAIN):
            return kind.removesuffix(PLAIN), {}
        base, sep, j = kind.rpartition(VARIANT)
        if not sep or not j.isdigit():
            return kind, None
        return base, {n: (r, lora.scaling(a, r, self.rslora))
                      for n, (r, a) in self.variants[int(j)].items()}

    def scales(self, kinds: dict[str, str]) -> dict[tuple[str, str], float]:
        """(layer, module) -> its scale where it is not --lora-alpha / --lora-rank's, for the
        layers of ``kinds`` (layer name -> kind)."""
        return {(layer, n): s for layer, kind in kinds.items()
                for n, (_, s) in (self.of(kind)[1] or {}).items()}

    def pattern_config(self) -> dict:
        """What PEFT's adapter config says of it (beyond r, lora_alpha, layers)."""
        return {"rank_pattern": {k: int(v) for k, v in self.ranks.items()},
                "alpha_pattern": dict(self.alphas),
                "exclude_modules": sorted(self.excluded) or None}


def outside_blocks(model) -> dict[str, str]:
    """--lora-targets names that name a module of the embeddings or the head (-> its name
    there): PEFT would adapt those too (an embedding, an LM head), LoRA here adapts the blocks'
    linear layers only."""
    want = lora.targets(model.cfg.lora_targets, model.config.model_type)
    found: dict[str, str] = {}
    for kind in ("embed", "head") if want else ():
        with torch.device("meta"), SkipInitOnMeta():
            stage = families.make_stage(model.config, model.family, kind)
        for name, _ in stage.named_modules():
            if name.rpartition(".")[2] in want:
                found.setdefault(name.rpartition(".")[2], name)
    return found


def peft_moves(model_type: str) -> set[str]:
    """Target names PEFT turns into a mixture of experts' stacked parameters when it loads an
    adapter of ``model_type`` (its conversion to transformers 5's layout: gate_proj, up_proj,
    down_proj of a Qwen2-MoE-like model, w1, w2, w3 of a Mixtral-like one): adapters on linear
    layers of those names (a dense or shared MLP's) would not load. Empty without PEFT."""
    try:
        from peft.utils import transformers_weight_conversion as conv
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return set()
    try:
        base = conv._MODEL_TO_CONVERSION_PATTERN.get(model_type)
        if base is None or get_checkpoint_conversion_mapping(model_type) is None or \
                not conv._MOE_FUSED_TARGETS.get(base):
            return set()
        return set(conv._MOE_TARGET_MODULE_MAPPING.get(base, {}))
    except (AttributeError, TypeError):  # (another PEFT: nothing known to move)
        return set()
