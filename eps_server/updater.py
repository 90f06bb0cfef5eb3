"""How a layer's reduced gradient becomes an update: learning-rate schedule, fp16 loss scaling
and overflow skips, gradient clipping, eager or deferred (math-thread functions, no I/O).

eager (L2Lp): each layer is updated as soon as its gradient is reduced, while the workers
    compute the layers below. Clipping uses the layer's own gradient norm; a layer whose fp16
    gradient overflowed skips its update, and the loss scale drops for the next step.
deferred: updates wait until every layer of the step is reduced. Clipping uses the global
    norm over all layers (torch.nn.utils.clip_grad_norm_), and one overflow anywhere skips the
    whole step (torch.amp.GradScaler). Updates then run layer 0 first, so the next step's
    forward can start while the upper layers are still being updated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import OptimizerConfig, ServerConfig
from .reducer import all_finite

CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


class LossScaler:
    """Dynamic loss scale (fp16): halve on an overflowing step, double after ``window`` clean
    steps in a row. ``scale`` is the scale of the step all layers are working on."""

    def __init__(self, initial: float, window: int, enabled: bool):
        self.enabled = enabled
        self.scale = initial if enabled else 1.0
        self.window = window
        self.good_steps = 0

    def step_done(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale = max(self.scale * 0.5, 2.0 ** -24)
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps >= self.window:
                self.scale *= 2.0
                self.good_steps = 0


@dataclass
class LayerStats:
    finite: bool
    norm_sq: float  # of the (still loss-scaled) gradient; 0 when not needed


class Updater:
    def __init__(self, cfg: ServerConfig, reducer, optimizers):
        self.cfg = cfg
        self.reducer = reducer
        self.optimizers = optimizers
        self.scaler = LossScaler(cfg.loss_scale, cfg.loss_scale_window, cfg.loss_scaling)
        self.overflow_steps: set[int] = set()
        self.skipped_updates = 0

    def stats(self, layer: int, norm: bool) -> LayerStats:
        """Finiteness (fp16) and, if ``norm``, squared norm of a reduced gradient: one pass."""
        g = self.reducer.grads[layer]
        if norm:
            n = float(torch.linalg.vector_norm(g, dtype=torch.float64))
            return LayerStats(math.isfinite(n), n * n)
        return LayerStats(all_finite(g) if self.cfg.loss_scaling else True, 0.0)

    def deferred_stats(self, layer: int) -> LayerStats:
        """Deferred: always measure the norm, so clipping switched on mid-step (SetHyper)
        still sees every layer's."""
        return self.stats(layer, norm=True)

    def apply(self, layer: int, t: int, grad_scale: float, cfg: OptimizerConfig) -> None:
        self.optimizers[layer].step(t, lr=cfg.lr_at(t), grad_scale=grad_scale, cfg=cfg)

    def eager(self, layer: int, t: int) -> bool:
        """Update one layer now; False if its gradient overflowed and the update was skipped."""
        cfg = self.optimizers[layer].cfg  # read once: SetHyper may swap the settings meanwhile
        s = self.stats(layer, norm=bool(cfg.clip_norm))
        if not s.finite:
            self.overflow_steps.add(t)
            self.skipped_updates += 1
            return False
        self.apply(layer, t, self.scaler.scale / self._clip(math.sqrt(s.norm_sq),
                                                            cfg.clip_norm), cfg)
        return True

    def deferred_plan(self, stats: dict[int, LayerStats], t: int, cfg: OptimizerConfig
                      ) -> float | None:
        """The whole step's decision: None to skip every layer (overflow), else the gradient
        divisor (loss scale over the global clipping coefficient)."""
        if not all(s.finite for s in stats.values()):
            self.overflow_steps.add(t)
            self.skipped_updates += len(stats)
            return None
        total = math.sqrt(sum(s.norm_sq for s in stats.values()))
        return self.scaler.scale / self._clip(total, cfg.clip_norm)

    def _clip(self, scaled_norm: float, clip: float) -> float:
        """Clipping coefficient for a (loss-scaled) gradient norm."""
        if not clip:
            return 1.0
        return min(1.0, clip / (scaled_norm / self.scaler.scale + CLIP_EPS))

    def step_done(self, t: int) -> None:
        self.scaler.step_done(t in self.overflow_steps)
