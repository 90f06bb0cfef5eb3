"""Evaluation on the executor's layers: forward only, layer-major, u micro-batches at a time,
so that it needs no more device memory than a training step (no stash, no gradients)."""

from __future__ import annotations

import torch


class Evaluation:
    """Mixed into the Executor (its plans, binders, source, tied tensors and tracer)."""

    def evaluate(self, version: int, batches, prefetch_after: bool) -> tuple[float, int, int]:
        """Forward only (dropout off, no stash, no gradients) with the weights of ``version``:
        layer-major passes over ``batches``, u micro-batches at a time (so device memory is that
        of a training step); returns (summed loss, correct, loss terms)."""
        loss, correct, count = 0.0, 0, 0
        u = len(self.micro_batches)
        for binder in self.binders.values():
            binder.module.eval()
        try:
            for lo in range(0, len(batches), u):
                chunk = [b.to(self.device) for b in batches[lo:lo + u]]
                last = lo + u >= len(batches)
                for out, c in self._forward_only(version, chunk, prefetch_after or not last):
                    loss, correct = loss + float(out), correct + int(c)
                count += sum(int((b.targets != -100).sum()) for b in chunk)
        finally:
            for binder in self.binders.values():
                binder.module.train()
        return loss, correct, count

    def _forward_only(self, version: int, batches: list, prefetch_after: bool) -> list:
        xs: list = [None] * len(batches)
        n = len(self.plans)
        try:
            for layer in range(n):
                with self.tracer.span(f"E{layer}", "eval"):
                    weights = self._weights(layer, version, requires_grad=False)
                    if layer + 1 < n or prefetch_after:
                        self.source.prefetch((layer + 1) % n, version)
                    stage = self.binders[self.plans[layer].kind].bind(weights)
                    with torch.no_grad():
                        for i, batch in enumerate(batches):
                            xs[i] = stage(xs[i], batch)
                self.source.release(layer, version)
        finally:
            self.tied.clear()
        return xs
