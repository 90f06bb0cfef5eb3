"""One Hugging Face model type as the stages build it (``families.ARCH`` lists them): where the
library keeps its modules and classes, and what its model-level ``forward`` does around the
layers (a sliding-window rule, scaled embeddings, a logits divisor, its final norm)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from .experts import ExpertNames


@dataclass(frozen=True)
class Arch:
    """One model type: the library's module and class-name prefix, and what its model-level
    ``forward`` does around the layers."""

    prefix: str  # class names: f"{prefix}DecoderLayer", f"{prefix}Embeddings", ...
    module: str  # transformers.models.<module>.modeling_<module>
    sliding: str = "never"  # which layers slide: "never", "all" (when sliding_window is set),
    #                         or "layer_types" (the config lists each layer's kind)
    scaled_embedding: bool = False  # Gemma: the embedding module multiplies by sqrt(hidden)
    multipliers: bool = False  # Granite: embedding_multiplier in, logits / logits_scaling out
    nope_layers: bool = False  # SmolLM3: the layers no_rope_layers marks 0 use no rotary
    softcap: bool = False  # Gemma 2: logits = tanh(logits / cap) * cap (final_logit_softcapping)
    experts: ExpertNames | None = None  # a mixture of experts: its checkpoint names (experts.py)
    rotary_by_type: bool = False  # OLMo 3, Gemma 3: a rotary per layer type (local, global)
    classifier: str = "ForSequenceClassification"  # its sequence classifier's class name
    rotary: str = "RotaryEmbedding"  # its rotary module's class name (Qwen3.5: the text one's;
    #                                  "": none, Kimi Linear's layers have no rotary)
    norm: str = "rms"  # its final norm: RMSNorm, "cohere" (LayerNorm, no bias), "layer"
    #                    (torch's), "olmo" (no parameters), "layer1p" (Nemotron's)
    logit_scale: bool = False  # Cohere: logits times logit_scale
    embedding_dropout: str = ""  # the config's dropout after the embedding (StarCoder2's
    #                              embedding_dropout, Phi's embd_pdrop)
    head_bias: str = ""  # the LM head has a bias: "use_bias" when the config's says (ERNIE
    #                      4.5), "always" (Phi)
    final_norm_name: str = "norm"  # the final norm's name (Phi: final_layernorm)
    layer_class: str = "DecoderLayer"  # its layer's class name (GPT-NeoX: Layer)
    embed_padding: bool = True  # its token embedding has the config's padding index (no
    #                             gradient there; GPT-NeoX's has none)
    saved_as: tuple[tuple[str, str], ...] = ()  # (the library's, the checkpoint's) starts of
    #                                            names that differ (GPT-NeoX's head: embed_out)
    text_classes: bool = False  # Llama 4: its layers' classes are "<prefix>Text<name>"
    aux_loss: bool = True  # a MoE whose causal LM adds the load-balancing loss it is asked for
    causal_skip: bool = True  # False: the causal mask is always made (DeepSeek-V3.2's indexer
    #                           reads it), never left to SDPA's is_causal
    full_slides: bool = False  # MiniMax: its full-attention layers slide when sliding_window
    #                            is set
    rope_optional: bool = False  # Granite 4.0-H: rotary only where position_embedding_type
    #                              says "rope"
    untrained: tuple[str, ...] = ()  # a block's modules the library runs without gradients
    #                                  (DeepSeek-V3.2's indexer): frozen, as AdamW leaves them

    def cls(self, name: str):
        """The library's class ``name`` of this model type (e.g. "DecoderLayer"); None if it
        has none."""
        module = importlib.import_module(f"transformers.models.{self.module}.modeling_"
                                         f"{self.module}")
        text = getattr(module, f"{self.prefix}Text{name}", None) if self.text_classes else None
        return text or getattr(module, f"{self.prefix}{name}", None)

    def attention(self) -> str:
        """The attention from_pretrained picks by default: SDPA where the model supports it
        (Gemma 2's soft-capped attention does not: eager)."""
        return "sdpa" if self.cls("PreTrainedModel")._supports_sdpa else "eager"

    def experts_implementation(self) -> str:
        """The experts' computation from_pretrained picks by default: grouped matmuls where the
        model can set it."""
        return ("grouped_mm" if self.cls("PreTrainedModel")._can_set_experts_implementation()
                else "eager")
