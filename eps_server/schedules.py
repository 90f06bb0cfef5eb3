"""Learning-rate schedules: a pure function of the update index.

For update t = 0, 1, 2, ... (the step being applied) and base rate ``lr``:

    warmup (t < W):  lr * (t + 1) / W
    then, with progress p = (t - W) / max(1, T - W) clipped to [0, 1]:
      constant:      lr
      linear:        lr * (m + (1 - m) * (1 - p))
      cosine:        lr * (m + (1 - m) * (1 + cos(pi * p)) / 2)

W = ``warmup_steps``, T = ``total_steps``, m = ``min_ratio`` (the floor as a fraction of lr).
Unlike some trainers, the first update does not use a zero rate.
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def lr_at(t: int, lr: float, schedule: str = "constant", warmup_steps: int = 0,
          total_steps: int = 0, min_ratio: float = 0.0) -> float:
    if t < warmup_steps:
        return lr * (t + 1) / warmup_steps
    if schedule == "constant":
        return lr
    p = min(1.0, max(0.0, (t - warmup_steps) / max(1, total_steps - warmup_steps)))
    if schedule == "linear":
        return lr * (min_ratio + (1 - min_ratio) * (1 - p))
    if schedule == "cosine":
        return lr * (min_ratio + (1 - min_ratio) * (1 + math.cos(math.pi * p)) / 2)
    raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")
