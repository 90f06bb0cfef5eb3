"""Whether eager updates of a decided step (--clip-norm, fp16) update a layer before the step
is decided: the guess.

A decided step updates every layer with one global clipping coefficient (and skips all of them
on an fp16 overflow), known once every layer's gradient is in (updater.py). Eager updates guess
instead of waiting: layer l is updated at once, its gradient kept, when the gradients of l and
of every layer above it (which a backward pass completes first) are finite and their norm
together is within the clip; else it is held for the decision. So

- the guess is a pure function of the gradients and the order the layers came in (top down in
  every run of the reference worker): a run repeats bit for bit;
- a guess is wrong only when layers below push the norm over the clip (or overflow): the
  layers guessed are then undone and redone; the layer that takes the norm over, typically a
  spike, and every layer below it are held, so an undo never takes back an update dominated by
  a gradient far above the clip (kernels.adamw_undo is exact to the rounding of the terms it
  takes back, which such a gradient would make large relative to what remains);
- the last layer of the backward (layer 0) is updated at once exactly when the step needs no
  clipping, and never undone.

A layer's job waits (on its engine) for the norms of the layers above it, whose jobs were all
sent before it; a layer that came before a layer above it was sent is held without waiting.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .config import OptimizerConfig
from .updater import LayerStats, clip_coefficient


class StepNorms:
    """The squared gradient norms of one step's layers as their checks finish (engine
    threads record them; the guesses read them)."""

    def __init__(self, num_layers: int, clip: float):
        self.clip = clip
        self.scale = 1.0  # the step's loss scale (set before its first update is sent)
        self._norms: list[float | None] = [None] * num_layers
        self._cond = threading.Condition()

    def record(self, layer: int, norm_sq: float) -> None:
        """``layer``'s squared norm (0: every rank skipped it; not finite: an overflow)."""
        with self._cond:
            self._norms[layer] = norm_sq
            self._cond.notify_all()

    def guess(self, layer: int, norm_sq: float, stopping: Callable[[], bool]) -> bool:
        """Record ``layer``'s norm, wait for every layer above it; True if theirs and this
        one's together are finite and within the clip (the update would stand)."""
        self.record(layer, norm_sq)
        with self._cond:
            while any(n is None for n in self._norms[layer + 1:]):
                if stopping():
                    return False
                self._cond.wait(0.1)
            total = 0.0
            for n in reversed(self._norms[layer:]):  # one order: the same bits every run
                total += n
        return math.isfinite(total) and clip_coefficient(
            math.sqrt(total), self.clip, self.scale) == 1.0


@dataclass
class StepCheck:
    """A validated step while its layers come in."""

    t: int
    cfg: OptimizerConfig  # one setting for the whole step, whatever SetHyper does
    norms: StepNorms  # for the guesses (eager)
    scale: float | None = None  # its loss scale, read once step t-1 is done (first update)
    sent: set[int] = field(default_factory=set)  # layers whose Update was sent, or skipped
    stats: dict[int, LayerStats] = field(default_factory=dict)
    kept: dict[int, tuple[torch.Tensor, bool]] = field(default_factory=dict)  # -> speculated
    seconds: dict[int, float] = field(default_factory=dict)  # per layer: its jobs' time so far
