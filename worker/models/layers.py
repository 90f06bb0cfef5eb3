"""Transformer building blocks shared by the BERT- and GPT-style models (nanoGPT-like)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float, causal: bool):
        super().__init__()
        self.heads, self.dropout, self.causal = heads, dropout, causal
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, t, h))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc = nn.Linear(hidden, ffn)
        self.proj = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


def sum_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, norm: float):
    """(summed loss / norm, number of correct argmax predictions). Summing then dividing by the
    global count makes micro-batch and worker contributions add up to the global mean."""
    logits = logits.reshape(-1, logits.shape[-1]).float()
    targets = targets.reshape(-1)
    loss = F.cross_entropy(logits, targets, reduction="sum") / norm
    correct = (logits.detach().argmax(-1) == targets).sum()
    return loss, correct
