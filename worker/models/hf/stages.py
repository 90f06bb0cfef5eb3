"""Stages of Hugging Face models, built from the library's own modules (no attention or MLP is
written here): each wraps the layer module(s) of one visit and derives what the library's
model-level ``forward`` would hand them (position ids, the attention mask, rotary cos/sin)
from the micro-batch, on every call, with the library's own helpers.

Attribute names mirror the library's, so a stage's parameter names are the checkpoint's after
a per-layer prefix (families.py maps them).
"""

from __future__ import annotations

import importlib
import inspect

import torch
from torch import nn
from transformers.masking_utils import (
    create_bidirectional_mask,
    create_causal_mask,
    create_sliding_window_causal_mask,
)
from transformers.models.bert.modeling_bert import BertEmbeddings, BertLayer, BertPooler
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from ..layers import sum_cross_entropy


def _positions(x: torch.Tensor) -> torch.Tensor:
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)


# The masks' cache argument (none here: training); older transformers name it past_key_values.
_NO_CACHE = {"cache" if "cache" in inspect.signature(create_causal_mask).parameters
             else "past_key_values": None}


def _causal_mask(make, config, x: torch.Tensor, batch, positions: torch.Tensor):
    return make(config=config, inputs_embeds=x, attention_mask=batch.mask,
                position_ids=positions, **_NO_CACHE)


# ----------------------------------------------------------------------------- BERT


class BertEmbed(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = BertEmbeddings(config)

    def forward(self, x, batch):
        return self.embeddings(input_ids=batch.inputs, token_type_ids=batch.token_types)


class BertBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layer = BertLayer(config)

    def forward(self, x, batch):
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=x,
                                         attention_mask=batch.mask)
        return self.layer(x, mask)


class BertClassifier(nn.Module):
    """BertForSequenceClassification's head: pooler, dropout, classifier."""

    def __init__(self, config):
        super().__init__()
        self.pooler = BertPooler(config)
        p = config.classifier_dropout
        self.dropout = nn.Dropout(config.hidden_dropout_prob if p is None else p)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, x, batch):
        logits = self.classifier(self.dropout(self.pooler(x)))
        return sum_cross_entropy(logits, batch.targets, batch.norm)


# ----------------------------------------------------------------------------- GPT-2


class Gpt2Embed(nn.Module):
    """GPT2Model's embedding part: token + position embeddings, dropout."""

    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.drop = nn.Dropout(config.embd_pdrop)

    def forward(self, x, batch):
        ids = batch.inputs
        return self.drop(self.wte(ids) + self.wpe(_positions(ids)))


class Gpt2Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.block = GPT2Block(config, layer_idx=0)

    def forward(self, x, batch):
        mask = _causal_mask(create_causal_mask, self.config, x, batch, _positions(x))
        return self.block(x, attention_mask=mask)


class LmHead(nn.Module):
    """A final norm and the LM head (its weight may be tied to the token embedding)."""

    def __init__(self, norm: nn.Module, norm_name: str, hidden: int, vocab: int):
        super().__init__()
        setattr(self, norm_name, norm)
        self.norm_name = norm_name
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x, batch):
        logits = self.lm_head(getattr(self, self.norm_name)(x))
        return sum_cross_entropy(logits, batch.targets, batch.norm)


def gpt2_head(config) -> LmHead:
    return LmHead(nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon), "ln_f",
                  config.hidden_size, config.vocab_size)


# ----------------------------------------------------------------------------- Llama-style


def llama_classes(model_type: str) -> dict:
    """The decoder layer, rotary embedding and RMSNorm classes of a Llama-style family."""
    prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[model_type]
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return {k: getattr(module, f"{prefix}{k}") for k in ("DecoderLayer", "RotaryEmbedding",
                                                        "RMSNorm")}


class DecoderEmbed(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         config.pad_token_id)

    def forward(self, x, batch):
        return self.embed_tokens(batch.inputs)


class DecoderBlock(nn.Module):
    """One decoder layer, its rotary module (buffers only: one per worker) and its mask: full
    causal, or sliding-window for the layers the config says."""

    def __init__(self, config, layer_idx: int, sliding: bool):
        super().__init__()
        classes = llama_classes(config.model_type)
        self.config, self.sliding = config, sliding
        self.layer = classes["DecoderLayer"](config, layer_idx)
        self.rotary_emb = classes["RotaryEmbedding"](config)

    def forward(self, x, batch):
        positions = _positions(x)
        make_mask = create_sliding_window_causal_mask if self.sliding else create_causal_mask
        mask = _causal_mask(make_mask, self.config, x, batch, positions)
        cos_sin = self.rotary_emb(x, positions)
        return self.layer(x, attention_mask=mask, position_ids=positions,
                          position_embeddings=cos_sin)


def decoder_head(config) -> LmHead:
    norm = llama_classes(config.model_type)["RMSNorm"](config.hidden_size, eps=config.rms_norm_eps)
    return LmHead(norm, "norm", config.hidden_size, config.vocab_size)
