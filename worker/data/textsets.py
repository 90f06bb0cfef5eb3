"""Text data as micro-batches: which samples fill a micro-batch, and how they are padded.

Global sample position p (step s, global micro-batch i, row j of micro-batch size B, G global
micro-batches per step: p = o + ((s - s0)*G + i)*B + j, where (s0, o) is the job's origin: o
samples consumed before step s0, (0, 0) in a fresh run) is sample ``perm_e[p mod N]`` of epoch
e = p div N, the permutation a pure function of (seed, e). So the data of every step is a pure
function of the step: N workers x u micro-batches see one big batch's samples, and a resumed
run continues at the same position, also with another batch shape (the EPS's checkpoint
records the samples consumed, and its Welcome gives the origin: eps_server/data_position.py).

A micro-batch is padded to its longest sample, with an attention mask. Its loss is divided by
the number of real targets of the whole global step (padding excluded), which every worker
counts alike from the token lengths.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from ..models.base import Batch, derive_seed
from .tokens import Encoded, target_counts


class Order:
    """The sample at each global position: shuffled anew each epoch, by (seed, epoch)."""

    def __init__(self, n: int, seed: int, shuffle: bool):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            rng = np.random.default_rng(derive_seed(self.seed, "shuffle", epoch))
            self._perms[epoch] = rng.permutation(self.n) if self.shuffle else np.arange(self.n)
            if len(self._perms) > 2:
                self._perms.popitem(last=False)
        return self._perms[epoch]

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        out = np.empty(len(positions), dtype=np.int64)
        epochs = positions // self.n
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[positions[sel] % self.n]
        return out


class TextTask:
    """Samples of a tokenised file. ``objective`` "classify": one label per sample; "lm":
    next-token targets (documents, or windows of one stream when ``window`` is set)."""

    def __init__(self, enc: Encoded, objective: str, *, seed: int, shuffle: bool, pad_id: int,
                 micro_batch_size: int, global_micro_batches: int, window: int = 0):
        self.enc, self.objective, self.pad_id, self.window = enc, objective, pad_id, window
        self.size, self.count = micro_batch_size, global_micro_batches
        n = (len(enc.ids) - 1) // window if window else len(enc)
        if n < 1:
            raise ValueError(f"{len(enc.ids)} tokens in all, fewer than the {window + 1} of one "
                             f"--seq-len {window} sample (a smaller --seq-len?)")
        self.n = n
        self.order = Order(n, seed, shuffle)
        self.lengths = np.full(n, window + 1) if window else enc.lengths()
        self.targets = np.full(n, window) if window else target_counts(enc)  # lm, per sample
        # (step, samples): the samples the job consumed before that step (the EPS's Welcome
        # says: a run resumed with another batch shape goes on from where its checkpoint was)
        self.origin = (0, 0)

    def first_position(self, step: int) -> int:
        origin_step, samples = self.origin
        return samples + (step - origin_step) * self.count * self.size

    def step_positions(self, step: int, index: int, size: int) -> np.ndarray:
        first = self.first_position(step) + index * size
        return np.arange(first, first + size)

    def targets_per_sample(self, samples: np.ndarray) -> np.ndarray:
        if self.objective == "classify":
            return np.ones(len(samples), dtype=np.int64)
        return self.targets[samples]

    def loss_terms(self, step: int, size: int, count: int) -> int:
        """Real targets in the whole step (every worker's micro-batches)."""
        first = self.first_position(step)
        samples = self.order(np.arange(first, first + count * size))
        return int(self.targets_per_sample(samples).sum())

    def micro_batch(self, step: int, index: int, size: int, norm: float) -> Batch:
        return self.batch(self.order(self.step_positions(step, index, size)), norm)

    def batch(self, samples: np.ndarray, norm: float) -> Batch:
        rows, types, wanted = [], [], []
        for k in samples:
            if self.window:
                start = int(k) * self.window
                rows.append(self.enc.ids[start:start + self.window + 1])
            else:
                lo, hi = self.enc.starts[k], self.enc.starts[k + 1]
                rows.append(self.enc.ids[lo:hi])
                if self.enc.types is not None:
                    types.append(self.enc.types[lo:hi])
                if self.enc.targets is not None:
                    wanted.append(self.enc.targets[lo:hi])
        if self.window:  # windows of one stream: inputs and the next tokens, no padding
            w = torch.from_numpy(np.stack(rows).astype(np.int64))
            return Batch(w[:, :-1].contiguous(), w[:, 1:].contiguous(), norm)
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, r in enumerate(rows):
            ids[j, :len(r)] = torch.from_numpy(r.astype(np.int64))
            mask[j, :len(r)] = 1
        token_types = None
        if types:
            token_types = torch.zeros_like(ids)
            for j, t in enumerate(types):
                token_types[j, :len(t)] = torch.from_numpy(t.astype(np.int64))
        if self.objective == "classify":
            targets = torch.from_numpy(self.enc.labels[samples].astype(np.int64))
        else:  # position t predicts token t+1; padding, the last token and tokens not
            #    wanted (prompts, the user's turns) have no target
            keep = mask.clone()
            for j, w in enumerate(wanted):
                keep[j, :len(w)] = torch.from_numpy(w.astype(np.int64))
            targets = torch.full_like(ids, -100)
            targets[:, :-1] = torch.where(keep[:, 1:] == 1, ids[:, 1:], -100)
        return Batch(ids, targets, norm, mask, token_types)


class EvalSet:
    """Every sample once, in file order, in micro-batches of ``size``; worker ``rank`` of
    ``world`` takes micro-batches rank, rank + world, ... Losses are sums (norm 1)."""

    def __init__(self, task: TextTask, size: int, rank: int, world: int):
        self.task, self.size = task, size
        total = -(-task.n // size)
        self.indices = list(range(rank, total, world))

    def batches(self) -> list[Batch]:
        n = self.task.n
        out = []
        for j in self.indices:
            out.append(self.task.batch(np.arange(j * self.size, min((j + 1) * self.size, n)),
                                       1.0))
        return out
