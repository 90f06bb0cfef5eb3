"""A layered network of the kind the built-in models are not: its boundary activation is a
tuple (hidden states, a gate, and the integer token ids passed along), and its head reads a
tensor of the embedding layer. Run it with ``--model tests.toy_model:GatedModel``."""

from __future__ import annotations

import torch
from torch import nn

from worker.models.base import LayeredModel
from worker.models.layers import sum_cross_entropy


class Embed(nn.Module):
    def __init__(self, vocab: int, hidden: int, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.gate = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, batch):
        h = self.drop(self.tok(batch.inputs))
        return h, torch.sigmoid(self.gate(h)), batch.inputs


class GatedBlock(nn.Module):
    def __init__(self, hidden: int, dropout: float):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)
        self.mix = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, batch):
        h, g, ids = x
        h = h + g * self.drop(torch.tanh(self.fc(h)))
        g = torch.sigmoid(self.mix(g) + (ids[..., None] % 3).float())
        return h, g, ids


class Head(nn.Module):
    """Scores each class by its tied embedding row, from the mean hidden state."""

    def __init__(self, vocab: int, hidden: int, classes: int):
        super().__init__()
        self.classes = classes
        self.norm = nn.LayerNorm(hidden)
        self.tok = nn.Embedding(vocab, hidden)  # tied to pre's tok.weight

    def forward(self, x, batch):
        h, g, _ = x
        pooled = self.norm((h * g).mean(dim=1))
        logits = pooled @ self.tok.weight[:self.classes].t()
        return sum_cross_entropy(logits, batch.targets, batch.norm)


class GatedModel(LayeredModel):
    name = "gated"
    objective = "classify"
    default_task = "trigger"

    def make_stage(self, kind: str) -> nn.Module:
        c = self.cfg
        if kind == "embed":
            return Embed(c.vocab, c.hidden, c.dropout)
        if kind == "block":
            return GatedBlock(c.hidden, c.dropout)
        return Head(c.vocab, c.hidden, c.classes)

    def layer_kinds(self):
        return ([("pre", "embed")] + [(f"blocks.{i}", "block") for i in range(self.cfg.layers)]
                + [("post", "head")])

    def meta(self):
        c = self.cfg
        return {"model": "gated", "layers": c.layers, "hidden": c.hidden, "vocab": c.vocab,
                "classes": c.classes}

    def ties(self):
        return {("post", "tok.weight"): ("pre", "tok.weight")}


class ReaderBlock(GatedBlock):
    """A gated block that also reads the (tied) token embedding of the ids it is passed."""

    def __init__(self, vocab: int, hidden: int, dropout: float):
        super().__init__(hidden, dropout)
        self.tok = nn.Embedding(vocab, hidden)

    def forward(self, x, batch):
        h, g, ids = super().forward(x, batch)
        return h + 0.5 * self.tok(ids), g, ids


class SharedEmbeddingModel(GatedModel):
    """Every block and the head read pre's token embedding: one tensor, many readers."""

    def make_stage(self, kind: str) -> nn.Module:
        if kind == "block":
            return ReaderBlock(self.cfg.vocab, self.cfg.hidden, self.cfg.dropout)
        return super().make_stage(kind)

    def ties(self):
        ties = {(f"blocks.{i}", "tok.weight"): ("pre", "tok.weight")
                for i in range(self.cfg.layers)}
        return {**ties, **super().ties()}
