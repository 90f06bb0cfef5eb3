"""GPT-style decoder LM: token + position embeddings -> pre-LN causal blocks -> LN + LM head.

With ``tie_embeddings`` the LM head reads the token embedding (as GPT-2 does): the manifest
ties ``post``'s ``out.weight`` to ``pre``'s ``tok.weight``, so the EPS keeps one tensor and
the worker sums both layers' gradients of it.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import Batch, LayeredModel
from .layers import MLP, SelfAttention, sum_cross_entropy


class Embeddings(nn.Module):
    def __init__(self, vocab: int, seq_len: int, hidden: int, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq_len, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: None, batch: Batch) -> torch.Tensor:
        ids = batch.inputs
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.drop(self.tok(ids) + self.pos(pos))


class DecoderBlock(nn.Module):
    """Pre-LN: x = x + drop(attn(LN(x))); x = x + drop(mlp(LN(x)))."""

    def __init__(self, hidden: int, heads: int, ffn: int, dropout: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = SelfAttention(hidden, heads, dropout, causal=True)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, ffn)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


class LMHead(nn.Module):
    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor, batch: Batch):
        return sum_cross_entropy(self.out(self.norm(x)), batch.targets, batch.norm)


class GptModel(LayeredModel):
    name = "gpt"
    objective = "lm"
    default_task = "markov"

    def make_stage(self, kind: str) -> nn.Module:
        c = self.cfg
        if kind == "embed":
            return Embeddings(c.vocab, c.seq_len, c.hidden, c.dropout)
        if kind == "decoder":
            return DecoderBlock(c.hidden, c.heads, c.ffn, c.dropout)
        if kind == "lm_head":
            return LMHead(c.hidden, c.vocab)
        raise KeyError(kind)

    def layer_kinds(self) -> list[tuple[str, str]]:
        return ([("pre", "embed")] + [(f"blocks.{i}", "decoder") for i in range(self.cfg.layers)]
                + [("post", "lm_head")])

    def meta(self):
        c = self.cfg
        return {"model": "gpt", "layers": c.layers, "hidden": c.hidden, "heads": c.heads,
                "ffn": c.ffn, "seq_len": c.seq_len, "vocab": c.vocab}

    def ties(self):
        if not getattr(self.cfg, "tie_embeddings", False):
            return {}
        return {("post", "out.weight"): ("pre", "tok.weight")}
