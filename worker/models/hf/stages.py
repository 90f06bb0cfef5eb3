"""Stages of Hugging Face models, built from the library's own modules (no attention or MLP is
written here): each wraps the layer module(s) of one visit and derives what the library's
model-level ``forward`` would hand them (position ids, the attention mask, rotary cos/sin)
from the micro-batch, on every call, with the library's own helpers.

Attribute names mirror the library's, so a stage's parameter names are the checkpoint's after
a per-layer prefix (families.py maps them).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers.masking_utils import (
    create_bidirectional_mask,
    create_causal_mask,
    create_chunked_causal_mask,
    create_sliding_window_causal_mask,
)
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from ..layers import sum_cross_entropy
from .balance import RouterLogits


def _positions(x: torch.Tensor) -> torch.Tensor:
    return torch.arange(x.shape[1], device=x.device).unsqueeze(0)


# The masks' cache argument (none here: training); older transformers name it past_key_values.
_NO_CACHE = {"cache" if "cache" in inspect.signature(create_causal_mask).parameters
             else "past_key_values": None}


def _causal_mask(make, config, x: torch.Tensor, batch, positions: torch.Tensor,
                 skip: bool = True):
    return make(config=config, inputs_embeds=x, attention_mask=batch.mask,
                position_ids=positions, **_NO_CACHE,
                **({} if skip else {"allow_is_causal_skip": False}))


# ----------------------------------------------------------------------------- encoders


class EncoderEmbed(nn.Module):
    """BERT's or RoBERTa's embeddings (RoBERTa's derive positions from the padding itself)."""

    def __init__(self, config, arch):
        super().__init__()
        self.embeddings = arch.cls("Embeddings")(config)
        # one segment type (RoBERTa): every token is type 0 whatever the tokenizer said
        self.types = config.type_vocab_size > 1

    def forward(self, x, batch):
        return self.embeddings(input_ids=batch.inputs,
                               token_type_ids=batch.token_types if self.types else None)


class EncoderBlock(nn.Module):
    def __init__(self, config, arch):
        super().__init__()
        self.config = config
        self.layer = arch.cls("Layer")(config)

    def forward(self, x, batch):
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=x,
                                         attention_mask=batch.mask)
        return self.layer(x, mask)


class BertClassifier(nn.Module):
    """BertForSequenceClassification's head: pooler, dropout, classifier."""

    def __init__(self, config, arch):
        super().__init__()
        self.pooler = arch.cls("Pooler")(config)
        p = config.classifier_dropout
        self.dropout = nn.Dropout(config.hidden_dropout_prob if p is None else p)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, x, batch):
        logits = self.classifier(self.dropout(self.pooler(x)))
        return sum_cross_entropy(logits, batch.targets, batch.norm)


class RobertaClassifier(nn.Module):
    """RobertaForSequenceClassification's head (the library's: first token, dense, tanh,
    projection)."""

    def __init__(self, config, arch):
        super().__init__()
        self.classifier = arch.cls("ClassificationHead")(config)

    def forward(self, x, batch):
        return sum_cross_entropy(self.classifier(x), batch.targets, batch.norm)


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
    """A final norm and the LM head (its weight may be tied to the token embedding); Granite
    divides the logits by ``divisor``, Gemma 2 soft-caps them at ``softcap``; a mixture of
    experts' ``balance`` adds its load-balancing loss in training (balance.py)."""

    def __init__(self, norm: nn.Module, norm_name: str, hidden: int, vocab: int,
                 divisor: float = 1.0, softcap: float | None = None, balance=None,
                 scale: float = 1.0, bias: bool = False):
        super().__init__()
        setattr(self, norm_name, norm)
        self.norm_name, self.divisor, self.softcap = norm_name, divisor, softcap
        self.scale = scale  # (Cohere multiplies the logits)
        self.lm_head = nn.Linear(hidden, vocab, bias=bias)
        self.balance = balance

    def forward(self, x, batch):
        if self.balance:
            x, *totals = x
        logits = self.lm_head(getattr(self, self.norm_name)(x))
        if self.divisor != 1.0:
            logits = logits / self.divisor
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        loss, correct = sum_cross_entropy(logits, batch.targets, batch.norm)
        if self.balance and self.training:
            loss = loss + self.balance.loss(totals, batch)
        return loss, correct


def gpt2_head(config) -> LmHead:
    return LmHead(nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon), "ln_f",
                  config.hidden_size, config.vocab_size)


# ----------------------------------------------------------------------------- Llama-style


class DecoderEmbed(nn.Module):
    """The token embedding (Gemma's scales by sqrt(hidden) in the weights' dtype; Granite
    multiplies by ``embedding_multiplier``, AFMoE with muP by sqrt(hidden))."""

    def __init__(self, config, arch, balance=None):
        super().__init__()
        args = (config.vocab_size, config.hidden_size,
                config.pad_token_id if arch.embed_padding else None)
        if arch.scaled_embedding:
            scaled = arch.cls("TextScaledWordEmbedding")
            self.embed_tokens = scaled(*args, embed_scale=config.hidden_size ** 0.5)
        else:
            self.embed_tokens = nn.Embedding(*args)
        self.multiplier = (config.embedding_multiplier if arch.multipliers
                           else config.hidden_size ** 0.5 if getattr(config, "mup_enabled", False)
                           else 1.0)  # (Granite; AFMoE's muP)
        self.dropout = (nn.Dropout(getattr(config, arch.embedding_dropout))
                        if arch.embedding_dropout else None)
        self.balance = balance

    def forward(self, x, batch):
        x = self.embed_tokens(batch.inputs)
        x = x * self.multiplier if self.multiplier != 1.0 else x
        x = self.dropout(x) if self.dropout is not None else x
        return self.balance.start(x) if self.balance else x


def checkpoint_buffers(module: nn.Module) -> None:
    """A layer's persistent buffers (in the checkpoint, never trained: DeepSeek-V3's and
    GLM-4.5's router ``e_score_correction_bias``) as parameters that do not require grad, so
    they are served with the layer's weights and frozen (base.py's manifest)."""
    for sub in module.modules():
        for name, buf in list(sub._buffers.items()):
            if buf is not None and name not in sub._non_persistent_buffers_set:
                del sub._buffers[name]
                sub.register_parameter(name, nn.Parameter(buf, requires_grad=False))


class DecoderBlock(nn.Module):
    """One decoder layer (built as layer ``layer_idx``, which the config may set apart: its
    window, its rotary), its rotary module (buffers only: one per worker; none for Kimi
    Linear, or where Granite 4.0-H's config asks for none) and its mask: full causal,
    sliding-window or chunked (Llama 4) for the layers the config says, the padding alone for
    linear-attention and Mamba layers. With a ``balance`` the boundary also carries the
    routing totals, to which a MoE layer adds its router's (balance.py)."""

    def __init__(self, config, arch, layer_idx: int, mixer: str = "block", balance=None):
        super().__init__()
        self.config, self.mixer = config, mixer  # "block", "sliding", "chunked" or "linear"
        self.layer = arch.cls(arch.layer_class)(config, layer_idx)
        checkpoint_buffers(self.layer)
        for name, p in self.layer.named_parameters():
            if name.startswith(arch.untrained):  # (no gradient ever: frozen, not decayed)
                p.requires_grad_(False)
        rope = not arch.rope_optional or config.position_embedding_type == "rope"
        self.rotary_emb = arch.cls(arch.rotary)(config) if rope and arch.rotary else None
        self.passes_rotary = bool(arch.rotary)  # (else the layer takes no position_embeddings)
        # (OLMo 3, Gemma 3: the rotary of the layer's type, local or global)
        self.rotary_args = (config.layer_types[layer_idx],) if arch.rotary_by_type else ()
        self.balance = balance
        self.routers = RouterLogits(self.layer) if balance else None
        # (Gemma 4: a layer may record its keys and values for later ones; none reads them)
        self.shares_kv = "shared_kv_states" in inspect.signature(self.layer.forward).parameters
        self.causal_skip = arch.causal_skip

    def forward(self, x, batch):
        if self.balance:
            x, *totals = x
            self.routers.take()  # (what an interrupted call left)
        positions = _positions(x)
        if self.mixer == "linear":  # the 2-D padding mask (create_recurrent_attention_mask's;
            mask = batch.mask       # all ones where it passes None: the same product)
        else:
            make_mask = {"sliding": create_sliding_window_causal_mask,
                         "chunked": create_chunked_causal_mask}.get(self.mixer,
                                                                    create_causal_mask)
            mask = _causal_mask(make_mask, self.config, x, batch, positions, self.causal_skip)
        extra = {"shared_kv_states": {}} if self.shares_kv else {}
        if self.passes_rotary:
            extra["position_embeddings"] = (self.rotary_emb(x, positions, *self.rotary_args)
                                            if self.rotary_emb is not None else None)
        out = self.layer(x, attention_mask=mask, position_ids=positions, **extra)
        if not self.balance:
            return out
        for logits in self.routers.take():
            totals = self.balance.add(totals, logits, batch.mask)
        return (out, *totals)


class DecoderClassifier(nn.Module):
    """GenericForSequenceClassification's head: the final norm, the "score" projection, and
    the logits of each row's rightmost token that is not padding (as the library picks it:
    by ``pad_token_id``; without one, the last token the attention mask keeps)."""

    def __init__(self, config, arch):
        super().__init__()
        self.norm_name = arch.final_norm_name
        setattr(self, self.norm_name, final_norm(config, arch))
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.pad = config.pad_token_id

    def forward(self, x, batch):
        ids = batch.inputs
        real = (ids != self.pad) if self.pad is not None else (
            batch.mask.bool() if batch.mask is not None else torch.ones_like(ids, dtype=bool))
        positions = torch.arange(ids.shape[1], device=ids.device, dtype=torch.int32)
        last = (positions * real.to(torch.int32)).argmax(-1)
        pooled = getattr(self, self.norm_name)(x[torch.arange(ids.shape[0], device=ids.device),
                                                 last])
        return sum_cross_entropy(self.score(pooled), batch.targets, batch.norm)


def final_norm(config, arch) -> nn.Module:
    """The model's final norm, as the library builds it."""
    if arch.norm == "cohere":  # (Cohere 2 MoE's is an RMSNorm where its config sets the eps)
        if getattr(config, "rms_norm_eps", None) is not None:
            return arch.cls("RMSNorm")(hidden_size=config.hidden_size, eps=config.rms_norm_eps)
        return arch.cls("LayerNorm")(hidden_size=config.hidden_size, eps=config.layer_norm_eps)
    if arch.norm == "layer":  # (its eps: StarCoder2's norm_epsilon, StableLM's layer_norm_eps,
        eps = next(getattr(config, k) for k in ("norm_epsilon", "layer_norm_eps",  # PhiMoE's
                                                "rms_norm_eps") if hasattr(config, k))  # rms)
        return nn.LayerNorm(config.hidden_size, eps=eps)
    if arch.norm == "olmo":  # OLMo's: no weight nor bias
        return arch.cls("LayerNorm")(config.hidden_size)
    if arch.norm == "layer1p":  # Nemotron's: LayerNorm with weight + 1
        return arch.cls("LayerNorm1P")(config.hidden_size, eps=config.norm_eps)
    return arch.cls("RMSNorm")(config.hidden_size, eps=config.rms_norm_eps)


def decoder_head(config, arch, balance=None) -> LmHead:
    return LmHead(final_norm(config, arch), arch.final_norm_name, config.hidden_size,
                  config.vocab_size,
                  config.logits_scaling if arch.multipliers else 1.0,
                  config.final_logit_softcapping if arch.softcap else None, balance,
                  config.logit_scale if arch.logit_scale else 1.0,
                  arch.head_bias == "always" or (arch.head_bias == "use_bias"
                                                 and config.use_bias))
