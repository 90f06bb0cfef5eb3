"""The supported Hugging Face model families, cut into L2L layers.

Each family says which library class the whole model is (for export), how the model splits
into ``pre`` / ``blocks.i`` / ``post``, which stage each layer is, which tensors are tied, and
how a stage's parameter names map to the checkpoint's: an explicit per-layer prefix table (as
nanoGPT's ``from_pretrained`` maps names), used both ways (load and export).

A family is a layout of names shared by several model types; each model type (``ARCH``) says
where the library keeps its modules and what its model-level ``forward`` adds around the layers
(a sliding-window rule, scaled embeddings, a logits divisor).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import stages
from .arch import Arch
from .balance import balance_of
from .experts import (
    ERNIE,
    EXAONE,
    GRANITE,
    HUNYUAN3,
    KIMI,
    MIMO,
    MIXTRAL,
    PHIMOE,
    QWEN,
    STACKED,
    sparse_layers,
)


@dataclass(frozen=True, eq=False)  # (compared and hashed as itself)
class Family:
    model_types: tuple[str, ...]
    hf_class: str  # the class of the whole model after the type's prefix (export writes it)
    objective: str  # "classify" or "lm"
    base_prefix: str  # how the class names its base model (a base-model checkpoint omits it)
    prefixes: dict  # stage kind group ("pre", "block", "post") -> [(stage prefix, hf prefix)]
    new_head: tuple[str, ...]  # checkpoint names a base-model checkpoint may lack (a new head)
    head: tuple[str, ...]  # the class's own head: read only from a checkpoint of this class

    def blocks(self) -> str:
        """The name of the module list of the blocks (layers, h, layer: PEFT's layers_pattern)."""
        return self.prefixes["block"][0][1].split(".{i}")[0].rpartition(".")[2]

    def hf_name(self, layer: str, tensor: str) -> str:
        """The library's name of ``layer``'s ``tensor`` (as its model holds it)."""
        group, i = ("block", layer.split(".")[1]) if layer.startswith("blocks.") else (layer, "")
        for ours, theirs in self.prefixes[group]:
            if tensor.startswith(ours):
                return theirs.format(i=i) + tensor[len(ours):]
        raise KeyError(f"no checkpoint name for {layer}.{tensor}")


ARCH = {
    "bert": Arch("Bert", "bert"),
    "roberta": Arch("Roberta", "roberta"),
    "xlm-roberta": Arch("XLMRoberta", "xlm_roberta"),
    "gpt2": Arch("GPT2", "gpt2"),
    "llama": Arch("Llama", "llama"),
    "mistral": Arch("Mistral", "mistral", sliding="all"),
    "qwen2": Arch("Qwen2", "qwen2", sliding="layer_types"),
    "qwen3": Arch("Qwen3", "qwen3", sliding="layer_types"),
    "phi3": Arch("Phi3", "phi3", sliding="all"),
    "olmo2": Arch("Olmo2", "olmo2"),
    "smollm3": Arch("SmolLM3", "smollm3", sliding="layer_types", nope_layers=True),
    "gemma": Arch("Gemma", "gemma", scaled_embedding=True),
    "gemma2": Arch("Gemma2", "gemma2", sliding="layer_types", scaled_embedding=True,
                   softcap=True),
    "granite": Arch("Granite", "granite", multipliers=True),
    "mixtral": Arch("Mixtral", "mixtral", sliding="all", experts=MIXTRAL),
    "qwen2_moe": Arch("Qwen2Moe", "qwen2_moe", sliding="layer_types", experts=QWEN),
    "qwen3_moe": Arch("Qwen3Moe", "qwen3_moe", sliding="all", experts=QWEN),
    "olmoe": Arch("Olmoe", "olmoe", experts=QWEN),
    "deepseek_v3": Arch("DeepseekV3", "deepseek_v3", experts=QWEN),
    "glm4_moe": Arch("Glm4Moe", "glm4_moe", experts=QWEN),
    "gpt_oss": Arch("GptOss", "gpt_oss", sliding="layer_types", experts=STACKED),
    "minimax_m2": Arch("MiniMaxM2", "minimax_m2", experts=MIXTRAL),
    "deepseek_v2": Arch("DeepseekV2", "deepseek_v2", experts=QWEN),
    "dots1": Arch("Dots1", "dots1", sliding="layer_types", experts=QWEN),
    "olmo3": Arch("Olmo3", "olmo3", sliding="layer_types", rotary_by_type=True),
    "gemma3_text": Arch("Gemma3", "gemma3", sliding="layer_types", scaled_embedding=True,
                        rotary_by_type=True, classifier="TextForSequenceClassification"),
    "ministral3": Arch("Ministral3", "ministral3", sliding="all"),
    "exaone4": Arch("Exaone4", "exaone4", sliding="layer_types"),
    "seed_oss": Arch("SeedOss", "seed_oss"),
    "hunyuan_v1_dense": Arch("HunYuanDenseV1", "hunyuan_v1_dense"),
    "helium": Arch("Helium", "helium"),
    "apertus": Arch("Apertus", "apertus"),
    "arcee": Arch("Arcee", "arcee"),
    "cohere": Arch("Cohere", "cohere", norm="cohere", logit_scale=True),
    "glm4": Arch("Glm4", "glm4"),
    "ernie4_5_moe": Arch("Ernie4_5_Moe", "ernie4_5_moe", experts=ERNIE,
                         head_bias="use_bias"),
    "granitemoe": Arch("GraniteMoe", "granitemoe", multipliers=True, experts=GRANITE),
    # (Mistral 4's checkpoints keep the library's stacks: no conversion in transformers)
    "mistral4": Arch("Mistral4", "mistral4", experts=STACKED),
    "cohere2": Arch("Cohere2", "cohere2", sliding="layer_types", norm="cohere",
                    logit_scale=True),
    "starcoder2": Arch("Starcoder2", "starcoder2", sliding="all", norm="layer",
                       embedding_dropout="embedding_dropout"),
    "qwen3_next": Arch("Qwen3Next", "qwen3_next", sliding="layer_types", experts=QWEN),
    # Qwen3.5's language models (text: their positions are one, whatever the rotary sections)
    "qwen3_5_text": Arch("Qwen3_5", "qwen3_5", sliding="layer_types", rotary="TextRotaryEmbedding",
                         classifier="TextForSequenceClassification"),
    "qwen3_5_moe_text": Arch("Qwen3_5Moe", "qwen3_5_moe", sliding="layer_types", experts=QWEN,
                             rotary="TextRotaryEmbedding",
                             classifier="TextForSequenceClassification"),
    # Llama 4: chunked attention with rotary, NoPE full attention (temperature-tuned), MoE
    # and dense layers interleaved; its causal LM adds no load-balancing loss
    "llama4_text": Arch("Llama4", "llama4", sliding="layer_types", nope_layers=True,
                        experts=STACKED, text_classes=True, aux_loss=False),
    # Gemma 4: Gemma 3's shape, its full-attention layers with heads of their own size (keys
    # as values, where attention_k_eq_v says), every layer a dense MLP beside its experts
    # (enable_moe_block), a learned scalar per layer
    "gemma4_text": Arch("Gemma4", "gemma4", sliding="layer_types", scaled_embedding=True,
                        softcap=True, rotary_by_type=True, experts=STACKED, text_classes=True,
                        aux_loss=False),
    "ernie4_5": Arch("Ernie4_5", "ernie4_5"),
    "phi": Arch("Phi", "phi", norm="layer", embedding_dropout="embd_pdrop", head_bias="always",
                final_norm_name="final_layernorm"),
    "gpt_neox": Arch("GPTNeoX", "gpt_neox", norm="layer", embedding_dropout="hidden_dropout",
                     final_norm_name="final_layer_norm", layer_class="Layer",
                     embed_padding=False, saved_as=(("lm_head.", "embed_out."),)),
    "glm": Arch("Glm", "glm"),
    # mixtures of experts whose causal LMs add no balancing loss: Hunyuan-A13B, Solar Open,
    # K-EXAONE, Hunyuan 3 (its router, routing bias and shared expert under names of their
    # own) and AFMoE (Arcee Trinity: muP scales its embedding when mup_enabled says)
    "hunyuan_v1_moe": Arch("HunYuanMoEV1", "hunyuan_v1_moe", experts=QWEN, aux_loss=False),
    "solar_open": Arch("SolarOpen", "solar_open", experts=QWEN, aux_loss=False),
    "exaone_moe": Arch("ExaoneMoe", "exaone_moe", sliding="layer_types", experts=EXAONE,
                       aux_loss=False),
    "hy_v3": Arch("HYV3", "hy_v3", experts=HUNYUAN3, aux_loss=False),
    "afmoe": Arch("Afmoe", "afmoe", sliding="layer_types", experts=QWEN, aux_loss=False),
    # DeepSeek-V3.2: V3 with sparse attention (an indexer picks the keys each query reads)
    "deepseek_v32": Arch("DeepseekV32", "deepseek_v32", experts=QWEN, aux_loss=False,
                         causal_skip=False, untrained=("self_attn.indexer.",)),
    "glm4_moe_lite": Arch("Glm4MoeLite", "glm4_moe_lite", experts=QWEN, aux_loss=False),
    "cohere2_moe": Arch("Cohere2Moe", "cohere2_moe", sliding="layer_types", norm="cohere",
                        logit_scale=True, experts=QWEN, aux_loss=False),
    "granite_swa": Arch("GraniteSWA", "granite_swa", sliding="layer_types", multipliers=True),
    # MiniMax-Text-01: lightning (linear) attention layers among softmax ones
    "minimax": Arch("MiniMax", "minimax", sliding="layer_types", full_slides=True,
                    experts=MIXTRAL),
    "flex_olmo": Arch("FlexOlmo", "flex_olmo", experts=QWEN),
    # MiMo-V2-Flash: attention sinks, a rotary per layer type
    "mimo_v2_flash": Arch("MiMoV2Flash", "mimo_v2_flash", sliding="layer_types",
                          rotary_by_type=True, experts=MIMO, aux_loss=False),
    # Phi-3.5-MoE: a LayerNorm head, Mixtral's expert names, router noise
    "phimoe": Arch("Phimoe", "phimoe", sliding="all", norm="layer", experts=PHIMOE),
    "vaultgemma": Arch("VaultGemma", "vaultgemma", sliding="layer_types", scaled_embedding=True,
                       softcap=True),
    # Granite 4.0-H: Mamba-2 layers (masked by padding alone, as linear attention) among
    # attention ones, experts and a shared MLP, no rotary unless its config asks for it
    "granitemoehybrid": Arch("GraniteMoeHybrid", "granitemoehybrid", sliding="layer_types",
                             multipliers=True, experts=GRANITE, rope_optional=True),
    # Kimi Linear: Kimi delta attention (linear) layers and latent attention ones, no rotary
    "kimi_linear": Arch("KimiLinear", "kimi_linear", sliding="layer_types", rotary="",
                        experts=KIMI, aux_loss=False),
    # LayerNorm final norms: OLMo's without parameters, Nemotron's (weight + 1), StableLM's
    # and Jais 2's torch's
    "olmo": Arch("Olmo", "olmo", norm="olmo"),
    "nemotron": Arch("Nemotron", "nemotron", norm="layer1p"),
    "stablelm": Arch("StableLm", "stablelm", norm="layer"),
    "jais2": Arch("Jais2", "jais2", norm="layer"),
}

BERT = Family(("bert",), "ForSequenceClassification", "classify", "bert.", {
    "pre": [("embeddings.", "bert.embeddings.")],
    "block": [("layer.", "bert.encoder.layer.{i}.")],
    "post": [("pooler.", "bert.pooler."), ("classifier.", "classifier.")]},
              ("classifier.", "bert.pooler."),  # a masked LM's checkpoint has no pooler
              ("classifier.",))

# RoBERTa's sequence classifier has no pooler: its head reads the first token
ROBERTA = Family(("roberta", "xlm-roberta"), "ForSequenceClassification", "classify",
                 "roberta.", {
                     "pre": [("embeddings.", "roberta.embeddings.")],
                     "block": [("layer.", "roberta.encoder.layer.{i}.")],
                     "post": [("classifier.", "classifier.")]}, ("classifier.",),
                 ("classifier.",))

GPT2 = Family(("gpt2",), "LMHeadModel", "lm", "transformer.", {
    "pre": [("wte.", "transformer.wte."), ("wpe.", "transformer.wpe.")],
    "block": [("block.", "transformer.h.{i}.")],
    "post": [("ln_f.", "transformer.ln_f."), ("lm_head.", "lm_head.")]}, ("lm_head.",),
              ())  # its LM head is the token embedding

DECODER = Family(("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "smollm3", "gemma",
                  "gemma2", "granite", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3",
                  "glm4_moe", "gpt_oss", "minimax_m2", "deepseek_v2", "dots1", "olmo3",
                  "gemma3_text", "ministral3", "exaone4", "seed_oss", "hunyuan_v1_dense",
                  "helium", "apertus", "arcee", "qwen3_next", "qwen3_5_text",
                  "qwen3_5_moe_text", "cohere", "cohere2", "starcoder2", "glm4", "mistral4",
                  "ernie4_5_moe", "granitemoe", "llama4_text", "gemma4_text", "ernie4_5", "glm",
                  "hunyuan_v1_moe", "solar_open", "exaone_moe", "hy_v3", "afmoe",
                  "deepseek_v32", "glm4_moe_lite", "cohere2_moe", "granite_swa", "olmo",
                  "nemotron", "stablelm", "jais2", "minimax", "flex_olmo", "mimo_v2_flash",
                  "phimoe", "vaultgemma", "granitemoehybrid", "kimi_linear", "phi"),
                 "ForCausalLM", "lm", "model.", {
    "pre": [("embed_tokens.", "model.embed_tokens.")],
    "block": [("layer.", "model.layers.{i}.")],
    "post": [("norm.", "model.norm."), ("final_layernorm.", "model.final_layernorm."),
             ("lm_head.", "lm_head.")]}, ("lm_head.",), ("lm_head.",))

# A decoder as a sequence classifier (the library's GenericForSequenceClassification): the
# final norm, then a "score" projection of the last real token
DECODER_CLASSIFIER = Family(DECODER.model_types, "ForSequenceClassification", "classify",
                            "model.", {**DECODER.prefixes,
                                       "post": [*DECODER.prefixes["post"][:2],
                                                ("score.", "score.")]},
                            ("score.",), ("score.",))

# GPT-NeoX (Pythia): the decoders' stages under its own names
NEOX = Family(("gpt_neox",), "ForCausalLM", "lm", "gpt_neox.", {
    "pre": [("embed_tokens.", "gpt_neox.embed_in.")],
    "block": [("layer.", "gpt_neox.layers.{i}.")],
    "post": [("final_layer_norm.", "gpt_neox.final_layer_norm."), ("lm_head.", "lm_head.")]},
    ("lm_head.",), ("lm_head.",))
NEOX_CLASSIFIER = Family(NEOX.model_types, "ForSequenceClassification", "classify",
                         "gpt_neox.", {**NEOX.prefixes, "post": [NEOX.prefixes["post"][0],
                                                                 ("score.", "score.")]},
                         ("score.",), ("score.",))
CLASSIFIER_OF = {DECODER: DECODER_CLASSIFIER, NEOX: NEOX_CLASSIFIER}  # (of a decoder LM)
DECODER_CLASSIFIERS = tuple(CLASSIFIER_OF.values())

FAMILIES = {t: f for f in (BERT, ROBERTA, GPT2, DECODER, NEOX) for t in f.model_types}


def classifies(config) -> bool:
    return any("ForSequenceClassification" in a for a in (config.architectures or ()))


def family_of(config, classes: int = 0) -> Family:
    """The family of ``config``'s model type; a decoder is a sequence classifier when its
    checkpoint is one or ``classes`` asks for a new classifier head."""
    family = FAMILIES.get(config.model_type)
    if family is None:
        raise ValueError(f"model type {config.model_type!r} is not supported; supported: "
                         f"{', '.join(sorted(FAMILIES))}")
    if family in CLASSIFIER_OF and (classes or classifies(config)):
        arch = ARCH[config.model_type]
        if arch.cls(arch.classifier) is None:
            raise ValueError(f"transformers has no sequence classifier for "
                             f"{config.model_type}: a model trained so could not be loaded")
        family = CLASSIFIER_OF[family]
    if classes and family.objective != "classify":  # it was ignored: trained as an LM
        raise ValueError(f"--classes {classes}: a {config.model_type} model trains here as a "
                         "language model only (no classifier head)")
    if config.model_type == "gpt2" and (config.scale_attn_by_inverse_layer_idx
                                        or config.reorder_and_upcast_attn):
        raise ValueError("GPT-2 with scale_attn_by_inverse_layer_idx or "
                         "reorder_and_upcast_attn computes each block differently; not supported")
    if config.model_type == "gemma4_text" and (config.hidden_size_per_layer_input
                                               or config.num_kv_shared_layers
                                               or config.use_bidirectional_attention == "all"):
        raise ValueError("Gemma 4 with per-layer embeddings (hidden_size_per_layer_input), "
                         "layers that reuse another layer's keys and values "
                         "(num_kv_shared_layers) or bidirectional attention is not supported: "
                         "here each layer is computed from the one before alone")
    if getattr(config, "is_decoder", False) and family in (BERT, ROBERTA):
        raise ValueError(f"a {config.model_type} decoder (is_decoder) is not supported; use an "
                         "encoder checkpoint")
    return family


def hf_class(config, family: Family) -> str:
    arch = ARCH[config.model_type]
    return arch.prefix + (arch.classifier if family in DECODER_CLASSIFIERS else family.hf_class)


def max_positions(config) -> int | None:
    """The longest sequence the position embeddings cover (a table of learned positions: BERT,
    RoBERTa's, whose positions start after its padding index, GPT-2's); None for rotary
    positions, which go on past max_position_embeddings as the library's do (context
    extension, YaRN and dynamic scaling)."""
    family = FAMILIES[config.model_type]
    if family not in (BERT, ROBERTA, GPT2):
        return None
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and family is ROBERTA:
        limit -= config.pad_token_id + 1
    return limit


BLOCKS = ("block", "sliding", "linear", "chunked")  # the decoder blocks' kinds (before "-")

# the stage kind of a layer type that is not full attention (Qwen3-Next's linear attention:
# gated delta rule layers, other parameters, masked by padding alone)
LAYER_KINDS = {"sliding_attention": "sliding", "linear_attention": "linear",
               "chunked_attention": "chunked"}  # (Llama 4: attention within fixed chunks)


def block_kinds(config) -> list[str]:
    """The stage kind of each block (blocks of one kind compute alike), by each model's own
    rule: Mistral and Phi-3 slide every layer when ``sliding_window`` is set, Qwen2/3, Gemma 2
    and SmolLM3 follow ``layer_types`` (its linear-attention, Mamba and Llama 4's chunked
    layers are kinds of their own), MiniMax's full-attention layers slide when
    ``sliding_window`` is set, the others never slide; SmolLM3's and Llama 4's
    ``no_rope_layers`` mark the layers without rotary ("-nope"), a MoE's dense layers are
    "-dense"."""
    n, arch = config.num_hidden_layers, ARCH[config.model_type]
    kinds = ["block"] * n
    if arch.sliding == "all" and getattr(config, "sliding_window", None) is not None:
        kinds = ["sliding"] * n
    elif arch.sliding == "layer_types" and getattr(config, "layer_types", None):
        kinds = [LAYER_KINDS.get(t, "block") for t in config.layer_types[:n]]
    if arch.full_slides and getattr(config, "sliding_window", None) is not None:
        kinds = ["sliding" if k == "block" else k for k in kinds]
    if arch.nope_layers:
        kinds = [k if config.no_rope_layers[i] else f"{k}-nope" for i, k in enumerate(kinds)]
    if arch.experts:
        kinds = [k if moe else f"{k}-dense" for k, moe in zip(kinds, sparse_layers(config))]
    return kinds


def make_stage(config, family: Family, kind: str):
    arch = ARCH[config.model_type]
    if family is BERT:
        return {"embed": stages.EncoderEmbed, "block": stages.EncoderBlock,
                "head": stages.BertClassifier}[kind](config, arch)
    if family is ROBERTA:
        return {"embed": stages.EncoderEmbed, "block": stages.EncoderBlock,
                "head": stages.RobertaClassifier}[kind](config, arch)
    if family is GPT2:
        return {"embed": stages.Gpt2Embed, "block": stages.Gpt2Block,
                "head": stages.gpt2_head}[kind](config)
    # a mixture of experts' load-balancing loss (causal LMs that train with it: balance.py)
    balance = (balance_of(config, family.objective == "lm" and arch.aux_loss) if arch.experts
               else None)
    if kind.split("-")[0] in BLOCKS:  # as the first of its kind
        kinds = block_kinds(config)
        return stages.DecoderBlock(config, arch, kinds.index(kind), kind.split("-")[0],
                                   balance)
    if family in DECODER_CLASSIFIERS:
        return {"embed": stages.DecoderEmbed, "head": stages.DecoderClassifier}[kind](config,
                                                                                   arch)
    return {"embed": stages.DecoderEmbed, "head": stages.decoder_head}[kind](config, arch,
                                                                           balance)


def ties(config, family: Family) -> dict:
    if family.objective == "classify" or not getattr(config, "tie_word_embeddings", False):
        return {}
    embedding = "wte.weight" if config.model_type == "gpt2" else "embed_tokens.weight"
    return {("post", "lm_head.weight"): ("pre", embedding)}
