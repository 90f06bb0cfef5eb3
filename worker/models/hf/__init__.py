"""Hugging Face models as layered models: ``--model hf:PATH`` (a local ``save_pretrained``
directory; nothing is downloaded).

Supported (families.py): BERT, RoBERTa and XLM-RoBERTa as sequence classifiers (a
``...ForSequenceClassification`` checkpoint, or any other of the type, e.g. a masked-LM or base
model, with a new head of ``--classes`` labels), GPT-2 (``GPT2LMHeadModel``, LM head tied to the
token embedding) and Llama-style decoders (``...ForCausalLM`` of the types ``families.ARCH``
lists, Llama, Qwen, Gemma and the others: grouped-query and latent attention, sliding-window
and no-rotary layers, tied embeddings, scaled embeddings, scaled or soft-capped logits; and the
mixtures of experts, Mixtral, Qwen-MoE, DeepSeek, gpt-oss and the others), these
but those the library has no classifier for (Granite, OLMoE, ...) also as sequence
classifiers (a ``...ForSequenceClassification`` checkpoint, or ``--classes`` on a causal LM's).
The stages call the library's own modules (stages.py); the EPS never sees any of this, only
the manifest.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import logging
import os

import torch

from ...inputs import hf_dir_problem
from ...spelled import lora_layers
from .. import lora
from ..base import LayeredModel, save_dtype
from . import adapter, families, lora_plan, multimodal, quantized
from .checkpoint import HfCheckpoint, export, unrounded
from .lora_plan import LoraPlan

log = logging.getLogger("l2l_worker")

PREFIX = "hf:"


def load_config(path: str):
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ValueError("--model hf:... needs transformers: pip install -e '.[hf]'") from None
    # Nothing is downloaded: without this the library takes a missing directory for a hub
    # name and says it could not reach the hub.
    problem = hf_dir_problem(path)
    if problem:
        raise ValueError(problem)
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read a Hugging Face config from {path}: {e}") from None


class HfModel(LayeredModel):
    name = "hf"
    default_task = "text"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.path = cfg.model[len(PREFIX):]
        self.source_config = load_config(self.path)
        quantized.method(self.source_config)  # (another quantization: refused before starting)
        # a multimodal checkpoint: its language model trains (multimodal.py)
        self.config, self.wrapper = multimodal.of(self.source_config)
        if self.wrapper and (cfg.classes or cfg.lora_target_parameters.strip()):
            raise ValueError(f"{self.path} is a multimodal {self.source_config.model_type}: "
                             "its language model trains as a causal LM (no --classes, no "
                             "--lora-target-parameters)")
        self.family = families.family_of(self.config, cfg.classes)
        self.objective = self.family.objective
        c = self.config
        # A checkpoint of another class (a masked LM, a token classifier, ...) gives its base
        # model; its head, even under the same names, is not this class's and is not read.
        source = (c.architectures or [None])[0]
        trained = families.hf_class(c, self.family)
        self.reads_head = source in (None, trained)
        if not self.reads_head:
            log.warning("%s is a %s: trained as a %s from its base model (its own head is not "
                        "read)", self.path, source, trained)
        # LoRA: the modules trained whole beside the adapters (PEFT's modules_to_save)
        self.lora_saved = lora.modules_to_save(cfg.lora_modules_to_save,
                                               self.objective == "classify")
        if self.objective == "classify":
            head_trains = any(lora.saved(h + "weight", self.lora_saved)
                              for h in self.family.head)
            if cfg.lora_rank and not head_trains and not (self.reads_head and
                                                          families.classifies(c)):
                raise ValueError(f"--lora-modules-to-save {cfg.lora_modules_to_save} leaves "
                                 f"the new classifier head ({self.path} is not a sequence "
                                 "classifier) frozen at its random start")
            self._labels(cfg.classes)
        if self.family in families.DECODER_CLASSIFIERS and c.pad_token_id is None:
            # pooled at the last token that is not padding: the config names the padding, the
            # data pads with it (data.text_task), and export writes it, so the library's
            # model pools alike; without one the tokenizer's, else its end-of-text (the usual
            # recipe for decoders without a padding token)
            c.pad_token_id = self._pad_id()
        limit = families.max_positions(c)
        if limit is not None and cfg.seq_len > limit:
            raise ValueError(f"--seq-len {cfg.seq_len} exceeds the {limit} positions the "
                             "model's position embeddings cover")
        # What from_pretrained would pick; the library's modules read it from the config.
        arch = families.ARCH[c.model_type]
        c._attn_implementation = c._attn_implementation or arch.attention()
        if arch.experts:
            c._experts_implementation = (c._experts_implementation
                                         or arch.experts_implementation())
        # randomness in training (the executor seeds each visit and its recompute alike):
        # dropout, and Mixtral's router jitter
        self.dropout = max((v for k, v in c.to_dict().items() if isinstance(v, float) and (
            "drop" in k or k == "router_jitter_noise")), default=0.0)
        self._kinds = families.block_kinds(c)
        beyond = [i for i in lora_layers(cfg.lora_layers) if i >= len(self._kinds)]
        if beyond:
            given = (f"--lora-init {cfg.lora_init}'s layers_to_transform" if cfg.lora_init
                     else "--lora-layers")
            raise ValueError(f"{given} {cfg.lora_layers}: the model has "
                             f"{len(self._kinds)} blocks (0-{len(self._kinds) - 1})")
        self.lora_modules: set[str] = set()  # names of the linear layers LoRA adapts
        self.lora_fan_in_fan_out = False  # whether they are Conv1D (GPT-2's: weight in x out)
        self.lora_stacked: dict = {}  # adapted expert stacks: adapter -> (parameter, transposed)

    def _labels(self, classes: int) -> None:
        """A sequence classifier's checkpoint decides its labels (--classes may only agree); a
        base-model checkpoint gets a new head of --classes labels."""
        c = self.config
        if c.problem_type not in (None, "single_label_classification"):
            raise ValueError(f"problem_type {c.problem_type!r} is not supported (single-label "
                             "classification only)")
        if families.classifies(c):
            if classes and classes != c.num_labels:
                raise ValueError(f"the checkpoint's classifier has {c.num_labels} labels, "
                                 f"--classes says {classes}")
            return
        if classes < 2:
            source = (c.architectures or ["a base-model checkpoint"])[0]
            raise ValueError(f"{self.path} is {source}, not a sequence classifier: it gets a "
                             "new classifier head, give --classes (2 or more)")
        c.num_labels = classes

    def _pad_id(self) -> int | None:
        try:
            tok = self.tokenizer()
        except ValueError:  # no tokenizer: token ids only, and the attention mask tells
            return None
        return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def pad_id(self, tokenizer) -> int:
        """A decoder classifier's config's padding (what it pools by), else the default."""
        if self.family in families.DECODER_CLASSIFIERS and self.config.pad_token_id is not None:
            return self.config.pad_token_id
        return super().pad_id(tokenizer)

    @functools.cached_property
    def lora_plan(self) -> LoraPlan:
        """Each block's adapted modules, their ranks and alphas (lora_plan.py)."""
        return LoraPlan(self)

    def make_stage(self, kind: str):
        cfg = self.cfg
        lora_block = bool(cfg.lora_rank) and kind not in ("embed", "head")
        base, only = self.lora_plan.of(kind) if lora_block else (kind, None)
        module = families.make_stage(self.config, self.family, base)
        if lora_block:  # LoRA on the blocks' linears (``only``: some, at their own shapes)
            found = lora.apply(module, cfg.lora_rank, lora.scaling(
                cfg.lora_alpha, cfg.lora_rank, cfg.lora_rslora), cfg.lora_targets,
                cfg.lora_dropout, self.config.model_type, cfg.lora_dora, only)
            stacked = {} if only == {} else lora.apply_parameters(  # (-plain: none)
                module, cfg.lora_rank, lora.scaling(cfg.lora_alpha, cfg.lora_rank,
                                                    cfg.lora_rslora), cfg.lora_target_parameters)
            self.lora_modules |= found.keys()
            self.lora_fan_in_fan_out |= any(found.values())
            self.lora_stacked.update(stacked)
        return module

    def adapter_name(self, layer: str, tensor: str) -> str:
        """A trained tensor's name in PEFT's adapter file (the library's, as PEFT holds it)."""
        name = self.family.hf_name(layer, tensor)
        return "base_model.model." + (self.wrapper.in_memory(name) if self.wrapper else name)

    def lora_trains(self):
        if not self.cfg.lora_rank:
            return None
        return lambda layer, tensor: lora.is_adapter(tensor) or lora.saved(
            self.family.hf_name(layer, tensor), self.lora_saved)

    def manifest(self):
        manifest = super().manifest()
        if not self.cfg.lora_rank:
            return manifest
        if not self.lora_modules and not self.cfg.lora_target_parameters.strip():
            raise ValueError(f"--lora-targets {self.cfg.lora_targets} matches no linear layer "
                             f"of a {self.config.model_type} block" + (  # (of any kind)
                                 " that --lora-exclude-modules and --lora-layers leave"
                                 if self.cfg.lora_exclude_modules or self.cfg.lora_layers
                                 else ""))
        if moved := sorted(lora_plan.peft_moves(self.config.model_type) & self.lora_modules):
            raise ValueError(
                f"--lora-targets {self.cfg.lora_targets} adapts the linear layers "
                f"{', '.join(moved)} (a dense or shared MLP's), but PEFT loads those names of a "
                f"{self.config.model_type} adapter as its experts' stacked parameters, so they "
                "would not load: leave them out (e.g. q_proj,k_proj,v_proj,o_proj), and adapt the "
                "experts with --lora-target-parameters gate_up_proj,down_proj")
        outside = lora_plan.outside_blocks(self)
        if only := [n for n in outside if n not in self.lora_modules]:
            raise ValueError(f"--lora-targets {only[0]}: the model's {outside[only[0]]}, outside "
                             "its blocks, which PEFT would adapt and l2l does not (LoRA goes on "
                             f"the blocks' linear layers); --lora-modules-to-save {only[0]} "
                             "trains it whole")
        if outside:  # (an adapter PEFT loads: it gives those its zero-effect new adapters)
            log.warning("LoRA: --lora-targets %s also names %s outside the blocks, which PEFT "
                        "would adapt too; l2l adapts the blocks' only", ",".join(outside),
                        ", ".join(outside.values()))
        if self.cfg.lora_target_parameters.strip() and not self.lora_stacked:
            raise ValueError(f"--lora-target-parameters {self.cfg.lora_target_parameters} "
                             f"matches no parameter of a {self.config.model_type} block (e.g. "
                             "gate_up_proj,down_proj: a mixture of experts' stacked experts)")
        given = self.cfg.lora_modules_to_save.strip()
        names = [self.family.hf_name(*(t.tie or (la.name, t.name)))
                 for la in manifest.layers for t in la.tensors]  # (a tie: its owner)
        unused = [m for m in self.lora_saved if not any(lora.saved(n, (m,)) for n in names)
                  and not (self.objective == "classify" and m in lora.CLASSIFIER_HEADS)]
        if unused and given not in ("auto", "none"):
            raise ValueError(f"--lora-modules-to-save {unused[0]!r} matches no module of the "
                             f"model (a tied tensor is its owner's, e.g. {names[0]})")
        for la in manifest.layers:  # PEFT would load a tied tensor's trained copy apart from
            for t in la.tensors:    # its reader (the LM head keeps the base embedding)
                name = self.family.hf_name(la.name, t.name)
                if lora.is_adapter(name) and lora.saved(lora.adapted(name) + ".w",
                                                        self.lora_saved):
                    raise ValueError(f"--lora-modules-to-save trains {lora.adapted(name)} "
                                     "whole, which --lora-targets adapts: PEFT would not adapt "
                                     "it (or not load the adapter); leave it out of one of them")
                if t.tie and lora.saved(self.family.hf_name(*t.tie), self.lora_saved):
                    raise ValueError(
                        f"--lora-modules-to-save trains {self.family.hf_name(*t.tie)}, which "
                        f"{name} reads (tied embeddings): PEFT's adapter would load it "
                        "untied; leave it out")
        if self.cfg.lora_init:
            adapter.check(self, manifest)
        return manifest

    def exported(self, plan) -> list[str]:
        if self.cfg.lora_rank and not self.cfg.merge:  # the adapter (and modules_to_save)
            trains = self.lora_trains()
            return [s.name for s in plan.tensors if trains(plan.name, s.name)]
        return super().exported(plan)

    def layer_kinds(self) -> list[tuple[str, str]]:
        kinds = self.lora_plan.kinds if self.cfg.lora_rank else self._kinds
        return ([("pre", "embed")] + [(f"blocks.{i}", k) for i, k in enumerate(kinds)]
                + [("post", "head")])

    def meta(self) -> dict:
        c = self.config.to_dict()
        facts = {k: v for k, v in c.items() if not k.startswith("_") and k not in (
            "transformers_version", "architectures", "name_or_path", "torch_dtype", "dtype")}
        digest = hashlib.sha256(repr(sorted(facts.items())).encode()).hexdigest()[:16]
        return {"model": "hf", "model_type": self.config.model_type, "config": digest,
                "num_labels": self.config.num_labels if self.objective == "classify" else 0}

    def ties(self):
        return families.ties(self.config, self.family)

    def loader(self, served: torch.dtype = torch.float32):
        if self._loader is None:
            self._loader = super().loader() if self.cfg.init_from else HfCheckpoint(self)
            if self.cfg.lora_init:  # (a PEFT adapter's values: its tensors)
                self._loader = adapter.AdapterInit(self, self._loader)
            elif self.cfg.lora_rank and not self.cfg.init_from:
                self.manifest()  # (whether the adapted layers are Conv1D)
                self._loader = lora.LoraInit(self._loader, self.cfg.seed,
                                             self.lora_fan_in_fan_out)
        if isinstance(self._loader, lora.LoraInit):
            self._loader.served = served
        return self._loader

    def save_dtype(self) -> torch.dtype:
        return save_dtype(self.cfg, self.config.dtype)

    def export_config(self):
        if self.wrapper:
            config = self.wrapper.export_config(self.save_dtype())
        else:
            config = copy.deepcopy(self.config)
            config.architectures = [families.hf_class(self.config, self.family)]
        config.dtype = self.save_dtype()  # what the files hold: from_pretrained loads that
        if hasattr(config, "quantization_config"):  # (a quantized source: written dequantized)
            del config.quantization_config
        return config

    def export(self, path: str, tensors: dict, metadata: dict) -> None:
        """(``tensors`` is consumed: frozen values and merged weights replace it in place.)"""
        cfg = self.cfg
        if not cfg.lora_rank:
            return export(self, path, unrounded(self, tensors))
        self.manifest()  # (the targeted modules' names and kinds)
        if cfg.merge:
            scale = lora.scaling(cfg.lora_alpha, cfg.lora_rank, cfg.lora_rslora)
            return export(self, path, lora.merged(
                unrounded(self, tensors), scale, self.lora_fan_in_fan_out, self.lora_stacked,
                self.lora_plan.scales(dict(self.layer_kinds()))))
        trains = self.lora_trains()
        named = {self.adapter_name(layer, n): t for (layer, n), t in tensors.items()
                 if trains(layer, n)}
        targets, layers = sorted(self.lora_modules), list(lora_layers(cfg.lora_layers))
        if self.wrapper:  # a pattern, so that PEFT leaves the vision tower be (the blocks in
            targets = self.wrapper.lora_pattern(targets, layers)  # it: PEFT's layers do not
            layers = []  # apply to a pattern)
        lora.adapter_files(path, named, {
            "peft_type": "LORA", "task_type": "CAUSAL_LM" if self.objective == "lm" else
            "SEQ_CLS", "base_model_name_or_path": os.path.abspath(self.path),
            "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout,
            "target_modules": targets, "bias": "none",
            "fan_in_fan_out": self.lora_fan_in_fan_out, "init_lora_weights": True,
            "inference_mode": True, "use_rslora": cfg.lora_rslora, "use_dora": cfg.lora_dora,
            "modules_to_save": list(self.lora_saved) or None,
            "layers_to_transform": layers or None,  # (and where a block's index is)
            "layers_pattern": self.family.blocks() if layers else None,
            **self.lora_plan.pattern_config(),
            **({"target_parameters": sorted(lora.names(cfg.lora_target_parameters))}
               if self.lora_stacked else {})}, self.save_dtype())

    def tokenizer(self):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"{self.path}: no usable tokenizer files ({e})") from None
