"""How a step's gradients become updates: fp16 loss scaling and overflow skips, global-norm
clipping (pure functions and the loss scaler; no threads, no I/O).

A step with clipping or fp16 is *decided* as a whole once every layer's gradient is in:
clipping uses the global norm over all layers (torch.nn.utils.clip_grad_norm_), and one
overflow anywhere skips the whole step (torch.amp.GradScaler), whether updates are eager (each
layer updated on a guess as its gradient comes, taken back if the guess was wrong:
speculation.py) or deferred (every layer waits for the decision). Updates after the decision
run layer 0 first, so the next step's forward can start while upper layers are updated.
Without clipping or fp16, eager updates are final at once (the L2Lp overlap).

An update of layer l for step t divides the summed gradient by ``grad_scale = loss_scale /
clip_coefficient`` (one number folded into the optimizer's kernel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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

    def state(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def restore(self, state: dict) -> None:
        if not self.enabled:  # (bf16/fp32 compute: the scale stays 1)
            return
        self.scale = state.get("scale", self.scale)
        self.good_steps = state.get("good_steps", 0)


@dataclass(frozen=True)
class LayerStats:
    """A reduced gradient's finiteness and squared norm (of the still loss-scaled values)."""

    finite: bool
    norm_sq: float


def clip_coefficient(scaled_norm: float, clip: float, loss_scale: float) -> float:
    """Clipping coefficient for a (loss-scaled) gradient norm; 1 when clipping is off."""
    if not clip:
        return 1.0
    return min(1.0, clip / (scaled_norm / loss_scale + CLIP_EPS))


def deferred_divisor(stats: dict[int, LayerStats], clip: float, loss_scale: float
                     ) -> float | None:
    """A decided step's outcome: None to skip every layer (an overflow anywhere), else the
    gradient divisor with one global clipping coefficient."""
    if not all(s.finite for s in stats.values()):
        return None
    total = math.sqrt(sum(s.norm_sq for s in stats.values()))
    return loss_scale / clip_coefficient(total, clip, loss_scale)
