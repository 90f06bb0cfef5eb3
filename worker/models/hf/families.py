"""The supported Hugging Face model families, cut into L2L layers.

Each family says which library class the whole model is (for export), how the model splits
into ``pre`` / ``blocks.i`` / ``post``, which stage each layer is, which tensors are tied, and
how a stage's parameter names map to the checkpoint's: an explicit per-layer prefix table (as
nanoGPT's ``from_pretrained`` maps names), used both ways (load and export).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import stages


@dataclass(frozen=True)
class Family:
    model_types: tuple[str, ...]
    hf_class: str  # the transformers class of the whole model (export writes its config)
    objective: str  # "classify" or "lm"
    base_prefix: str  # how the class names its base model (a base-model checkpoint omits it)
    prefixes: dict  # stage kind group ("pre", "block", "post") -> [(stage prefix, hf prefix)]
    new_head: tuple[str, ...]  # checkpoint names a base-model checkpoint may lack (a new head)

    def hf_name(self, layer: str, tensor: str) -> str:
        group, i = ("block", layer.split(".")[1]) if layer.startswith("blocks.") else (layer, "")
        for ours, theirs in self.prefixes[group]:
            if tensor.startswith(ours):
                return theirs.format(i=i) + tensor[len(ours):]
        raise KeyError(f"no checkpoint name for {layer}.{tensor}")


BERT = Family(("bert",), "BertForSequenceClassification", "classify", "bert.", {
    "pre": [("embeddings.", "bert.embeddings.")],
    "block": [("layer.", "bert.encoder.layer.{i}.")],
    "post": [("pooler.", "bert.pooler."), ("classifier.", "classifier.")]}, ("classifier.",))

GPT2 = Family(("gpt2",), "GPT2LMHeadModel", "lm", "transformer.", {
    "pre": [("wte.", "transformer.wte."), ("wpe.", "transformer.wpe.")],
    "block": [("block.", "transformer.h.{i}.")],
    "post": [("ln_f.", "transformer.ln_f."), ("lm_head.", "lm_head.")]}, ("lm_head.",))

DECODER = Family(("llama", "mistral", "qwen2"), "ForCausalLM", "lm", "model.", {
    "pre": [("embed_tokens.", "model.embed_tokens.")],
    "block": [("layer.", "model.layers.{i}.")],
    "post": [("norm.", "model.norm."), ("lm_head.", "lm_head.")]}, ("lm_head.",))

FAMILIES = {t: f for f in (BERT, GPT2, DECODER) for t in f.model_types}
CAUSAL_CLASS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM"}


def family_of(config) -> Family:
    family = FAMILIES.get(config.model_type)
    if family is None:
        raise ValueError(f"model type {config.model_type!r} is not supported; supported: "
                         f"{', '.join(sorted(FAMILIES))}")
    if config.model_type == "gpt2" and (config.scale_attn_by_inverse_layer_idx
                                        or config.reorder_and_upcast_attn):
        raise ValueError("GPT-2 with scale_attn_by_inverse_layer_idx or "
                         "reorder_and_upcast_attn computes each block differently; not supported")
    if getattr(config, "is_decoder", False) and config.model_type == "bert":
        raise ValueError("a BERT decoder (is_decoder) is not supported; use an encoder checkpoint")
    return family


def hf_class(config) -> str:
    family = family_of(config)
    return CAUSAL_CLASS.get(config.model_type, family.hf_class)


def block_kinds(config) -> list[str]:
    """The stage kind of each block, by each model's own rule: Mistral slides every layer when
    ``sliding_window`` is set, Qwen2 follows ``layer_types``, the others never slide."""
    n = config.num_hidden_layers
    if config.model_type == "mistral" and config.sliding_window is not None:
        return ["sliding"] * n
    if config.model_type == "qwen2" and getattr(config, "layer_types", None):
        return ["sliding" if t == "sliding_attention" else "block"
                for t in config.layer_types[:n]]
    return ["block"] * n


def make_stage(config, kind: str):
    t = config.model_type
    if t == "bert":
        return {"embed": stages.BertEmbed, "block": stages.BertBlock,
                "head": stages.BertClassifier}[kind](config)
    if t == "gpt2":
        return {"embed": stages.Gpt2Embed, "block": stages.Gpt2Block,
                "head": stages.gpt2_head}[kind](config)
    if kind in ("block", "sliding"):
        kinds = block_kinds(config)
        return stages.DecoderBlock(config, kinds.index(kind), kind == "sliding")
    return {"embed": stages.DecoderEmbed, "head": stages.decoder_head}[kind](config)


def ties(config) -> dict:
    if config.model_type == "bert" or not getattr(config, "tie_word_embeddings", False):
        return {}
    embedding = "wte.weight" if config.model_type == "gpt2" else "embed_tokens.weight"
    return {("post", "lm_head.weight"): ("pre", embedding)}
