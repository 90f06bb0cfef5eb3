"""Seeded synthetic tasks that a model can really learn: every micro-batch is a pure function
of (seed, step, global micro-batch index)."""

from __future__ import annotations

import numpy as np
import torch

from ..config import ModelConfig
from ..models.base import Batch, derive_seed


class TriggerTask:
    """Planted-rule classification (bert). Tokens [0, classes*k) are *triggers*, k per class; the
    rest are neutral. A sample of class c is neutral noise with 1-3 triggers of class c planted
    at random positions; position 0 holds a [CLS] token. A model must find the triggers anywhere
    in the sequence; chance accuracy is 1/classes."""

    objective = "classify"

    def __init__(self, cfg: ModelConfig, triggers_per_class: int = 4):
        self.cfg = cfg
        self.k = triggers_per_class
        self.cls_token = cfg.vocab - 1
        self.first_neutral = cfg.classes * self.k
        if self.first_neutral >= self.cls_token:
            raise ValueError("vocab too small for the trigger task: need > classes*4 + 1 tokens")

    def loss_terms(self, step: int, size: int, count: int) -> int:
        """Loss terms of a whole step (``count`` micro-batches of ``size``): one per sample."""
        return size * count

    def micro_batch(self, step: int, index: int, size: int, norm: float) -> Batch:
        c = self.cfg
        g = torch.Generator().manual_seed(derive_seed(c.seed, "data", step, index))
        labels = torch.randint(0, c.classes, (size,), generator=g)
        ids = torch.randint(self.first_neutral, self.cls_token, (size, c.seq_len), generator=g)
        count = torch.randint(1, 4, (size,), generator=g)
        for j in range(3):
            pos = torch.randint(1, c.seq_len, (size,), generator=g)
            trig = labels * self.k + torch.randint(0, self.k, (size,), generator=g)
            rows = torch.nonzero(count > j).squeeze(1)
            ids[rows, pos[rows]] = trig[rows]
        ids[:, 0] = self.cls_token
        return Batch(ids, labels, norm)


class MarkovTask:
    """Synthetic language (gpt): a sparse random Markov chain, each token followed by one of
    ``branching`` successors with random probabilities. Next-token loss can fall from ln(vocab)
    to the chain's entropy rate (``entropy``), which a model only reaches by learning it."""

    objective = "lm"

    def __init__(self, cfg: ModelConfig, branching: int = 4):
        self.cfg = cfg
        g = torch.Generator().manual_seed(derive_seed(cfg.seed, "markov"))
        v = cfg.vocab
        if v < branching:
            raise ValueError(f"vocab too small for the Markov task: need >= {branching} tokens")
        self.succ = distinct_successors(v, branching, g)
        self.probs = torch.softmax(2.0 * torch.randn(v, branching, generator=g), dim=-1)
        self.entropy = self._entropy_rate()
        # For sampling: a successor's index is how many of the row's first k-1 cumulative
        # probabilities a uniform draw reaches.
        self._succ = self.succ.numpy()
        self._bounds = self.probs.cumsum(-1)[:, :-1].numpy()

    def _entropy_rate(self) -> float:
        """Sum over tokens of the stationary probability times the entropy of its row; the
        stationary distribution by power iteration on the sparse transitions (v x branching:
        a dense v x v matrix would be 8 GB and minutes of work for a 32k vocabulary)."""
        v = self.cfg.vocab
        probs = self.probs.double()
        pi = torch.full((v,), 1.0 / v, dtype=torch.float64)
        flat = self.succ.flatten()
        for _ in range(500):
            pi = torch.zeros(v, dtype=torch.float64).scatter_add_(
                0, flat, (pi[:, None] * probs).flatten())
        h_row = -(probs * probs.log()).sum(-1)
        return float((pi * h_row).sum())

    def loss_terms(self, step: int, size: int, count: int) -> int:
        """Loss terms of a whole step: every position but the last of every sample."""
        return size * count * (self.cfg.seq_len - 1)

    def micro_batch(self, step: int, index: int, size: int, norm: float) -> Batch:
        """Every sample walks the chain from a uniform first token, with every uniform drawn
        up front (a torch multinomial per position took 0.9 s of a worker's step for 8 x 8 x
        1024 tokens): in numpy over the batch, or compiled for a large micro-batch."""
        c = self.cfg
        g = torch.Generator().manual_seed(derive_seed(c.seed, "data", step, index))
        first = torch.randint(0, c.vocab, (size,), generator=g).numpy()
        draws = torch.rand(c.seq_len - 1, size, 1, generator=g).numpy()
        walk = np.empty((c.seq_len, size), dtype=np.int64)
        compiled = size * c.seq_len >= COMPILED_WALK and compiled_walk()
        (compiled or numpy_walk)(first, draws, self._succ, self._bounds, walk)
        seq = torch.from_numpy(np.ascontiguousarray(walk.T))
        # Position t predicts token t+1; the last position has no target (-100 is ignored).
        targets = torch.cat([seq[:, 1:], torch.full((size, 1), -100)], dim=1)
        return Batch(seq, targets, norm)


def numpy_walk(first, draws, succ, bounds, walk) -> None:
    """``walk`` (T, B): B walks from ``first``; step t takes the successor whose index is how
    many of the row's cumulative probabilities ``bounds`` the uniform ``draws[t - 1]``
    reaches. Python steps over T, numpy over B: 15 us a position, 0.12 s for 8 x 8 x 1024."""
    walk[0] = first
    for t in range(1, walk.shape[0]):
        prev = walk[t - 1]
        walk[t] = succ[prev, (draws[t - 1] >= bounds[prev]).sum(1)]


def _walk_loops(first, draws, succ, bounds, walk):  # numpy_walk as plain loops, for numba
    for b in range(walk.shape[1]):
        s = first[b]
        walk[0, b] = s
        for t in range(1, walk.shape[0]):
            j = 0
            for c in range(bounds.shape[1]):
                j += draws[t - 1, b, 0] >= bounds[s, c]
            s = succ[s, j]
            walk[t, b] = s


COMPILED_WALK = 8192  # tokens in a micro-batch from which the walk is compiled (below, the
#                       ~1 s of importing numba and compiling costs more than it saves)
_compiled = None


def compiled_walk():
    """numpy_walk compiled by numba (the same comparisons, so the same tokens; 50x faster, and
    without the GIL), or None without numba."""
    global _compiled
    if _compiled is None:
        try:
            import numba
        except ImportError:
            _compiled = False
        else:
            _compiled = numba.njit(nogil=True, cache=False)(_walk_loops)
    return _compiled or None


def distinct_successors(v: int, k: int, g: torch.Generator) -> torch.Tensor:
    """(v, k): for each of v tokens, a uniformly drawn set of k distinct tokens of [0, v), by
    Floyd's algorithm for all rows at once: O(v k^2), not the O(v^2) of a permutation per row.
    The order within a row is not uniform (column i holds at most v - k + i), which does not
    matter to the chain: each column's probability is drawn alike."""
    chosen = torch.empty(v, k, dtype=torch.long)
    for i in range(k):
        top = v - k + i  # Floyd: draw from [0, top]; if taken, take top itself (never taken)
        t = torch.randint(0, top + 1, (v,), generator=g)
        taken = (chosen[:, :i] == t[:, None]).any(1)
        chosen[:, i] = torch.where(taken, torch.full_like(t, top), t)
    return chosen
