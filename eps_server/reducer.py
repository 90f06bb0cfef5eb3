"""Per-(step, layer) gradient reduction across workers, eager: each contribution is added the
moment it arrives, into an fp32 accumulator that is also the optimizer's gradient.

Bookkeeping (``claim``/``done``) runs on the event loop; the arithmetic (``add``) runs on a math
thread. The server serialises ``add`` calls of one layer (a per-layer lock); different layers
reduce in parallel.
"""

from __future__ import annotations

import torch

from protocol.tensors import Layout


class ReduceError(ValueError):
    """A push that cannot be accepted (duplicate, wrong step); the accumulator is untouched."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field


class Reducer:
    def __init__(self, layout: Layout, world_size: int):
        self.layout = layout
        self.world_size = world_size
        # One fp32 accumulator per layer, in the flat layout (padding stays zero).
        self.grads = [torch.zeros(p.numel, dtype=torch.float32) for p in layout.layers]
        self._claimed: list[set[int]] = [set() for _ in layout.layers]
        self._added = [0] * len(layout.layers)

    def claim(self, layer: int, rank: int) -> None:
        """Register that ``rank`` is pushing ``layer`` for the current step (event loop)."""
        if rank in self._claimed[layer]:
            raise ReduceError(f"rank {rank} already pushed layer {layer} for this step", "rank")
        self._claimed[layer].add(rank)

    def release(self, layer: int, rank: int) -> None:
        """Undo a claim whose gradient was rejected before it was added."""
        self._claimed[layer].discard(rank)

    def add(self, layer: int, src: torch.Tensor) -> None:
        """Accumulate one worker's gradient (math thread, under the layer's lock)."""
        acc = self.grads[layer]
        if src.numel() != acc.numel():
            raise ReduceError(f"gradient of layer {layer} has {src.numel()} elements, "
                              f"expected {acc.numel()}", "nbytes")
        if self._added[layer] == 0:
            acc.copy_(src)
        else:
            acc.add_(src)
        self._added[layer] += 1

    def complete(self, layer: int) -> bool:
        return self._added[layer] == self.world_size

    def reset(self, layer: int) -> None:
        """After the layer's update: ready for the next step."""
        self._claimed[layer].clear()
        self._added[layer] = 0


def all_finite(t: torch.Tensor) -> bool:
    """True if every element is finite, in one reduction pass: a NaN or inf anywhere makes the
    sum non-finite, while a float64 sum of finite fp32/bf16/fp16 values cannot overflow."""
    return bool(torch.isfinite(t.sum(dtype=torch.float64)))
