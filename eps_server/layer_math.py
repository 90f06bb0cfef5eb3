"""One layer's math: its optimizer and the passes over its gradient, each cut into pieces
that the math pool runs on every core (pool.py; the kernels are kernels.py's).

A step's gradient of a layer is the ranks' *parts* (one pushed gradient each, rank order),
read where they lie. ``check`` reads them once: which rank sent a non-finite element, whether
their sum overflowed, the sum's squared norm. Then either

    update(parts, keep=False)   the optimizer step, final (plain eager updates)
    update(parts, keep=True)    the same, and the summed gradient kept in a pooled buffer, so
                                that ``undo`` can take the step back (speculative updates)
    keep(parts)                 the summed gradient kept, the layer untouched (held updates)

and, once the step is decided, ``apply`` (a held update), ``undo`` (a speculative one taken
back) and ``release`` (the kept buffer given back). A kept gradient is exact: with one rank it
keeps that rank's dtype, with several the fp32 sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from protocol.tensors import LayerPlan

from . import kernels
from .buffers import BufferPool
from .config import OptimizerConfig
from .optimizers import LayerOptimizer
from .pool import MathPool, cut


@dataclass(frozen=True)
class Checked:
    """What ``check`` found in a step's gradient of a layer."""

    refused: tuple[int, ...]  # indices of the parts with a non-finite element
    overflow: bool  # every part finite, their sum not
    norm_sq: float  # the sum's squared norm (not finite if an element is not)

    @property
    def finite(self) -> bool:
        return not self.refused and not self.overflow


class LayerMath:
    def __init__(self, plan: LayerPlan, optimizer: LayerOptimizer, pool: MathPool,
                 buffers: BufferPool):
        self.plan, self.optimizer, self.pool, self.buffers = plan, optimizer, pool, buffers

    def check(self, parts: tuple[torch.Tensor, ...]) -> Checked:
        n = self.plan.numel
        for p in parts:  # a short part would be read past its end, not fail
            if p.numel() != n:
                raise ValueError(f"gradient of {p.numel()} elements for a layer of {n}")
        arrays = [kernels.as_kernel_array(p) for p in parts]
        sums = np.zeros(kernels.block_count(n))

        def piece(lo: int, hi: int) -> np.ndarray:
            bad = np.zeros(len(parts) + 1, dtype=np.uint8)
            b0, b1 = lo // kernels.BLOCK, kernels.block_count(hi)
            kernels.check(tuple(a[lo:hi] for a in arrays), sums[b0:b1], bad)
            return bad

        bad = np.bitwise_or.reduce(self.pool.map(piece, cut(0, n)))
        refused = tuple(int(k) for k in np.flatnonzero(bad[:len(parts)]))
        return Checked(refused, bool(bad[len(parts)]) and not refused, float(sums.sum()))

    def _kept_buffer(self, parts) -> torch.Tensor:
        """A kept gradient: the one part's dtype, else fp32; fp32 for optimizers that step on
        an fp32 gradient anyway (LAMB, SGD)."""
        single = len(parts) == 1 and self.optimizer.can_undo
        return self.buffers.take(self.plan.numel, parts[0].dtype if single else torch.float32)

    def update(self, parts, t: int, grad_scale: float, cfg: OptimizerConfig,
               keep: bool = False) -> torch.Tensor | None:
        """The optimizer step on sum(parts) / grad_scale; with ``keep`` (an optimizer that can
        undo), the sum kept: the buffer is returned."""
        kept = self._kept_buffer(parts) if keep else None
        self.optimizer.step(parts, t, lr=cfg.lr_at(t), grad_scale=grad_scale, cfg=cfg,
                            keep=kept)
        return kept

    def keep(self, parts) -> torch.Tensor:
        kept = self._kept_buffer(parts)
        if len(parts) == 1 and kept.dtype == parts[0].dtype:
            src, dst = parts[0], kept
            self.pool.map(lambda lo, hi: dst[lo:hi].copy_(src[lo:hi]), cut(0, self.plan.numel))
        else:
            self.optimizer._gather(parts, kept)
        return kept

    def summed(self, parts, numel: int | None = None, padded: int = 0) -> torch.Tensor:
        """sum(parts) in a pooled fp32 buffer (what crosses boxes; ``release`` it); in shard
        mode the parts are the whole layer's ``numel`` elements, and the buffer ``padded``
        long (zeros after the sum)."""
        if numel is None:
            out = self.buffers.take(self.plan.numel, torch.float32)
            self.optimizer._gather(parts, out)
            return out
        for p in parts:
            if p.numel() != numel:
                raise ValueError(f"gradient of {p.numel()} elements for a layer of {numel}")
        out = self.buffers.take(padded, torch.float32)
        out[numel:].zero_()
        arrays = [kernels.as_kernel_array(p) for p in parts]
        dst = kernels.as_kernel_array(out)
        self.pool.map(lambda lo, hi: kernels.gather(tuple(a[lo:hi] for a in arrays),
                                                    dst[lo:hi]), cut(0, numel))
        return out

    def apply(self, kept: torch.Tensor, t: int, grad_scale: float,
              cfg: OptimizerConfig) -> None:
        self.optimizer.step((kept,), t, lr=cfg.lr_at(t), grad_scale=grad_scale, cfg=cfg)

    def undo(self, kept: torch.Tensor, t: int, grad_scale: float,
             cfg: OptimizerConfig) -> None:
        self.optimizer.undo(kept, t, lr=cfg.lr_at(t), grad_scale=grad_scale, cfg=cfg)

    def release(self, kept: torch.Tensor | None) -> None:
        if kept is not None:
            self.buffers.give(kept)


FP16_OVERFLOW = 65520.0  # the smallest magnitude float16 rounds to inf (65504 is its largest)


def largest(t: torch.Tensor) -> float:
    """The largest magnitude in ``t`` (0 if empty; inf or NaN where an element is: min and
    max propagate NaN). Exact, nothing to overflow (initial values; the kernels check
    gradients)."""
    if t.numel() == 0:
        return 0.0
    lo, hi = torch.aminmax(t)
    return float(torch.maximum(-lo, hi))


def all_finite(t: torch.Tensor) -> bool:
    """True if every element is finite."""
    return math.isfinite(largest(t))
