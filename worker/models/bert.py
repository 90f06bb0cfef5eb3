"""BERT-style encoder classifier: embeddings -> post-LN encoder blocks -> pooler + classifier."""

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
        self.norm = nn.LayerNorm(hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: None, batch: Batch) -> torch.Tensor:
        ids = batch.inputs
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.drop(self.norm(self.tok(ids) + self.pos(pos)))


class EncoderBlock(nn.Module):
    """Post-LN, as in BERT: x = LN(x + drop(attn(x))); x = LN(x + drop(mlp(x)))."""

    def __init__(self, hidden: int, heads: int, ffn: int, dropout: float):
        super().__init__()
        self.attn = SelfAttention(hidden, heads, dropout, causal=False)
        self.norm1 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, ffn)
        self.norm2 = nn.LayerNorm(hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        x = self.norm1(x + self.drop(self.attn(x)))
        return self.norm2(x + self.drop(self.mlp(x)))


class Classifier(nn.Module):
    """Pooler (first token, dense + tanh) and a linear classifier; returns (loss, correct)."""

    def __init__(self, hidden: int, classes: int, dropout: float):
        super().__init__()
        self.pool = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, batch: Batch):
        logits = self.out(self.drop(torch.tanh(self.pool(x[:, 0]))))
        return sum_cross_entropy(logits, batch.targets, batch.norm)


class BertModel(LayeredModel):
    name = "bert"
    objective = "classify"
    default_task = "trigger"

    def make_stage(self, kind: str) -> nn.Module:
        c = self.cfg
        if kind == "embed":
            return Embeddings(c.vocab, c.seq_len, c.hidden, c.dropout)
        if kind == "encoder":
            return EncoderBlock(c.hidden, c.heads, c.ffn, c.dropout)
        if kind == "classifier":
            return Classifier(c.hidden, c.classes, c.dropout)
        raise KeyError(kind)

    def layer_kinds(self) -> list[tuple[str, str]]:
        return ([("pre", "embed")] + [(f"blocks.{i}", "encoder") for i in range(self.cfg.layers)]
                + [("post", "classifier")])

    def meta(self):
        c = self.cfg
        return {"model": "bert", "layers": c.layers, "hidden": c.hidden, "heads": c.heads,
                "ffn": c.ffn, "seq_len": c.seq_len, "vocab": c.vocab, "classes": c.classes}
