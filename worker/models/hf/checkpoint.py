"""Hugging Face checkpoints in and out, one tensor at a time.

In: ``HfCheckpoint`` reads a ``save_pretrained`` directory (``model.safetensors``, or shards
listed in ``model.safetensors.index.json``) as views of the mapped files, tensor by tensor, so
bootstrapping a large model never holds it (nor a copy of it) in the worker. A checkpoint of
the base model alone (e.g. ``BertModel`` for a sequence classifier) names its tensors without
the base prefix; tensors it lacks (a new classifier, BERT's pooler) are initialised as the
library initialises a Linear (matrices normal(0, initializer_range), vectors 0), seeded by
(seed, layer), and listed in a warning; a block's persistent buffers it lacks (a routing bias)
get the values the library's layer makes, as from_pretrained gives them. A mixture of experts'
per-expert tensors are stacked as the library stacks them (experts.py); FP8 and MXFP4 weights
are dequantized (quantized.py).

Out: ``export`` writes a directory ``from_pretrained`` loads: config (with the class and labels
of the trained model, and the dtype written), the weights as save_pretrained writes them
(``model.safetensors`` or shards and their index: shards.py) with the library's names (a tied
tensor once, under its owner's name; experts one by one), and the source's tokenizer files and
generation defaults.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import replace

import torch

from protocol.safetensors_io import SafetensorsFile
from protocol.tensors import LayerPlan, plan_layout

from ...config import size_bytes
from ...inputs import missing_shards
from ..base import derive_seed, params_on_meta
from . import families, quantized, shards

log = logging.getLogger("l2l_worker")

# Copied from the source directory on export: the tokenizer, and generation defaults (a chat
# model's end-of-turn ids: without them generate() does not stop at the end of a turn).
SOURCE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "vocab.txt", "vocab.json", "merges.txt", "tokenizer.model",
                "added_tokens.json", "chat_template.jinja", "chat_template.json",
                "generation_config.json", "preprocessor_config.json", "processor_config.json")


class HfCheckpoint:
    """The initial weights of an ``hf:`` model from its directory (a weight loader)."""

    def __init__(self, model):
        self.model, self.path = model, model.path
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                self.files = {k: os.path.join(self.path, v)
                              for k, v in json.load(f)["weight_map"].items()}
            if missing := missing_shards(self.path):
                raise ValueError(f"{index} lists {', '.join(missing)}, missing from "
                                 f"{self.path} (a copy or download not finished?)")
        elif os.path.isfile(os.path.join(self.path, "model.safetensors")):
            single = os.path.join(self.path, "model.safetensors")
            self.files = dict.fromkeys(SafetensorsFile(single).keys(), single)
        else:
            raise ValueError(f"{self.path}: no model.safetensors or model.safetensors.index.json "
                             "(only safetensors checkpoints are read)")
        self._open: dict[str, object] = {}
        self._buffers: tuple[int, dict] = (-1, {})  # (block, its buffers): _buffer_default
        self.experts = families.ARCH[model.config.model_type].experts
        self.saved_as = families.ARCH[model.config.model_type].saved_as
        quant = quantized.method(model.source_config)
        self.fp8_block = quantized.fp8_block(model.source_config) if quant == "fp8" else None
        self.mxfp4 = quant == "mxfp4"

    def _get(self, name: str) -> torch.Tensor | None:
        base, wrapper = self.model.family.base_prefix, self.model.wrapper
        names = [name, name[len(base):]] if name.startswith(base) else [name]
        if wrapper:  # (a multimodal checkpoint's language model: multimodal.py)
            names = wrapper.checkpoint(name)
        names += [saved(n, self.saved_as) for n in names if saved(n, self.saved_as) != n]
        # Old BERT checkpoints name LayerNorm parameters gamma/beta (the library renames them).
        legacy = {".weight": ".gamma", ".bias": ".beta"}
        names += [n[:-len(e)] + g for n in list(names) for e, g in legacy.items()
                  if "LayerNorm" in n and n.endswith(e)]
        for key in names:
            t = self.read(key)
            if t is not None:
                return t
        return None

    def read(self, key: str) -> torch.Tensor | None:
        """The checkpoint's tensor ``key`` (dequantized); None if it has none."""
        if key in self.files:
            t = self._tensor(key)
            if t.dtype in quantized.FP8 and self.fp8_block:
                scale = key + "_scale_inv"
                if scale not in self.files:
                    raise ValueError(f"{self.path}: {key} is FP8 with no {scale}")
                t = quantized.dequantize(t, self._tensor(scale), self.fp8_block)
            return t
        if self.mxfp4 and key + "_blocks" in self.files and key + "_scales" in self.files:
            return quantized.mxfp4(self._tensor(key + "_blocks"), self._tensor(key + "_scales"))
        return None

    def _tensor(self, key: str) -> torch.Tensor:
        path = self.files[key]
        if path not in self._open:
            self._open[path] = SafetensorsFile(path)
        return self._open[path].get(key)

    def load(self, plan: LayerPlan) -> dict[str, torch.Tensor]:
        out, fresh, defaults = {}, [], []
        gen = torch.Generator().manual_seed(derive_seed(self.model.cfg.seed, "init", plan.index))
        for slot in plan.tensors:
            name = self.model.family.hf_name(plan.name, slot.name)
            foreign = not self.model.reads_head and name.startswith(self.model.family.head)
            t = None if foreign else self._get(name)
            if t is None and not foreign and self.experts:
                t = self.experts.read(name, slot.shape, self._get)
            if t is None and not foreign and not name.startswith(self.model.family.new_head):
                t = self._buffer_default(plan, slot.name)
                if t is None:
                    raise ValueError(f"{self.path} has no tensor {name!r} (nor a legacy name "
                                     "of it); only a new head, or a buffer, may be missing")
                defaults.append(name)
            elif t is None:
                t = _fresh(slot.shape, self.model.config.initializer_range, gen)
                fresh.append(name)
            elif tuple(t.shape) != slot.shape:
                raise ValueError(f"{self.path}: {name} has shape {tuple(t.shape)}, the model "
                                 f"needs {slot.shape}")
            out[slot.name] = t
        if fresh:
            log.warning("%s has no %s: initialised fresh", self.path, ", ".join(fresh))
        if defaults:
            log.warning("%s has no %s: the library's values (as from_pretrained gives them)",
                        self.path, ", ".join(defaults))
        return out

    def _buffer_default(self, plan: LayerPlan, tensor: str) -> torch.Tensor | None:
        """The value the library gives a block's persistent buffer (a routing bias, MiniMax's
        decays, Gemma 4's layer scalar) that the checkpoint lacks, as its layer module makes
        it (weights on meta); None if ``tensor`` is no buffer."""
        if not (plan.name.startswith("blocks.") and tensor.startswith("layer.")):
            return None
        if self._buffers[0] != plan.index:
            arch = families.ARCH[self.model.config.model_type]
            with params_on_meta():
                layer = arch.cls(arch.layer_class)(self.model.config, int(plan.name[7:]))
            self._buffers = (plan.index, dict(layer.named_buffers()))
        return self._buffers[1].get(tensor[len("layer."):])


def saved(name: str, saved_as: tuple[tuple[str, str], ...]) -> str:
    """The name save_pretrained writes for the library's ``name`` (Arch.saved_as)."""
    for ours, theirs in saved_as:
        if name.startswith(ours):
            return theirs + name[len(ours):]
    return name


def _fresh(shape: tuple, std: float, gen: torch.Generator) -> torch.Tensor:
    """A new head's tensor as the library initialises it: normal(0, std), biases 0."""
    if len(shape) >= 2:
        return torch.empty(shape).normal_(0.0, std, generator=gen)
    return torch.zeros(shape)


def unrounded(model, tensors: dict[tuple[str, str], torch.Tensor]) -> dict:
    """``tensors``, in place, with each frozen one as the job's initial weights hold it where
    the given value is its rounding to bf16 or fp16: with 16-bit compute the EPS keeps a frozen
    tensor (a LoRA base, --freeze, a routing bias) only as its served copy, and the source (the
    checkpoint, an FP8 one's dequantized, or --init-from) has its exact value. Anything else is
    kept as given; a replaced tensor is let go at once (a merged base is not held twice)."""
    loader = None
    try:
        for plan in plan_layout(model.manifest()).layers:
            frozen = tuple(s for s in plan.tensors if s.group == "frozen" and _rounded(
                tensors.get((plan.name, s.name))))  # (else nothing to read: fp32 compute)
            if not frozen:
                continue
            try:
                loader = loader or model.loader()
                values = loader.load(replace(plan, tensors=frozen))
            except (ValueError, OSError) as e:  # (no source weights, or not these)
                log.warning("frozen tensors written as served: %s", e)
                return tensors
            for slot in frozen:
                key, exact = (plan.name, slot.name), values[slot.name]
                if exact.dtype == torch.float32 and any(
                        torch.equal(exact.to(d).float(), tensors[key])
                        for d in (torch.bfloat16, torch.float16)):
                    tensors[key] = exact
    finally:
        if loader is not None:
            model.drop_loader()  # (its files stay mapped only while they are read)
    return tensors


def _rounded(t: torch.Tensor | None) -> bool:
    """An fp32 tensor whose values a bf16 or fp16 one holds (a 16-bit served copy's)."""
    return t is not None and t.dtype == torch.float32 and any(
        torch.equal(t.to(d).float(), t) for d in (torch.bfloat16, torch.float16))


def kept_in_fp32(config, names: list[str]) -> set[str]:
    """The tensors among ``names`` that ``from_pretrained`` in ``config.dtype`` keeps in fp32
    (``_keep_in_fp32_modules_strict``, e.g. a router's weight and bias, and with fp16
    ``_keep_in_fp32_modules``, of the class and of its sub-models, as the library gathers
    them): save_pretrained then writes them in fp32, and so does the export."""
    if config.dtype not in (torch.float16, torch.bfloat16):
        return set()
    modules = set()
    for cls in _model_classes(config):
        modules |= set(getattr(cls, "_keep_in_fp32_modules_strict", None) or ())
        if config.dtype == torch.float16:
            modules |= set(getattr(cls, "_keep_in_fp32_modules", None) or ())
    if not modules:
        return set()
    pattern = re.compile("|".join(re.escape(m).replace(r"\*", ".*") for m in sorted(modules)))
    return {n for n in names if pattern.search(n)}


def _model_classes(config) -> list[type]:
    """The checkpoint's class and the models it holds (post_init gathers its children's
    lists): its base model, and each sub-config's (a multimodal model's language model)."""
    import transformers

    top = getattr(transformers, (config.architectures or [""])[0], None)
    classes, configs = [top] if top else [], [config]
    while configs:
        c = configs.pop()
        try:
            classes.append(transformers.MODEL_MAPPING[type(c)])
        except KeyError:
            pass
        configs += [sub for k in getattr(c, "sub_configs", {})
                    if isinstance(sub := getattr(c, k, None), transformers.PretrainedConfig)]
    return classes


def export(model, path: str, tensors: dict[tuple[str, str], torch.Tensor]) -> None:
    """Write ``tensors`` ((layer, tensor) -> value, every layer's own) as a Hugging Face
    directory at ``path``, in --save-dtype, split at --save-max-shard-size (shards.py)."""
    if os.path.isdir(path) and os.path.samefile(path, model.path):
        raise ValueError(f"{path} is the source directory; export elsewhere")
    if os.path.isdir(path) and os.listdir(path) and not os.path.isfile(
            os.path.join(path, "config.json")):
        raise ValueError(f"{path} is a non-empty directory that is not a model; not writing "
                         "into it")
    os.makedirs(path, exist_ok=True)
    config = model.export_config()
    arch = families.ARCH[model.config.model_type]
    named = [(saved(model.family.hf_name(layer, name), arch.saved_as), t)
             for (layer, name), t in tensors.items()]
    experts = arch.experts
    if experts:
        named = [pair for name, t in named for pair in experts.write(name, t)]
    if model.wrapper:  # the language model under its saved names, the rest as the source has
        source = HfCheckpoint(model)  # it (dequantized, as the config will not say quantized)
        named = [(model.wrapper.saved(n), t) for n, t in named] + [
            (k, source.read(k)) for k in source.files
            if not model.wrapper.is_language(k) and not k.endswith("_scale_inv")]
    shards.write_weights(path, named, config.dtype, size_bytes(model.cfg.save_max_shard_size),
                         {"format": "pt"}, kept_in_fp32(config, [n for n, _ in named]))
    config.save_pretrained(path)
    for name in SOURCE_FILES:
        src = os.path.join(model.path, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(path, name))
