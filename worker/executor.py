"""The L2L loop of one worker: layer-major forward over u micro-batches, boundary stash,
backward in reverse with recompute, each layer's gradient pushed as soon as it is complete.

Per step t (L layers: pre, blocks, post):

    forward   for l in 0..L-2:  w = weights(l, t); for each micro-batch: stash input, run stage
                                (the last block, L-2, runs with grad and keeps its graph)
    head      l = L-1:          forward + backward of the loss per micro-batch, push grad(L-1)
    backward  for l in L-2..0:  w = weights(l, t); for each micro-batch: recompute stage from
                                the stash with grad (L-2: use the kept graph), back-propagate,
                                accumulate; push grad(l)

Every visit takes its weights, then asks its layer source for the *next* visit's
(``prefetch``), so fetching overlaps compute and at most two layers are in flight; pushes are
asynchronous and the EPS reduces and updates a layer while the worker computes the layers
below. Dropout masks are seeded by (seed, step, layer,
global micro-batch) in the forward and the recompute alike, so gradients equal plain training's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from protocol.tensors import Layout, views
from protocol.trace import NULL, Tracer

from .data import Sharder
from .models.base import LayeredModel, dropout_seed, seeded
from .stash import make_stash
from .streams import Streams


@dataclass
class _Kept:
    """A layer's forward graph kept for its backward (per micro-batch)."""

    leaves: list[torch.Tensor]
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]


@dataclass
class StepResult:
    step: int
    loss: float  # this worker's share of the global mean loss (shares add up across workers)
    correct: int
    count: int  # loss terms (samples or tokens) on this worker
    samples: int
    seconds: float


class Executor:
    def __init__(self, model: LayeredModel, layout: Layout, source, sharder: Sharder, *,
                 device: torch.device, micro_batches: range, steps: int, dropout: float,
                 seed: int, stash: str = "device", tracer: Tracer = NULL):
        self.plans = layout.layers
        if len(self.plans) < 2:
            raise ValueError("a layered model needs at least two layers (pre ... post)")
        self.source = source
        self.sharder = sharder
        self.device = device
        self.micro_batches = list(micro_batches)
        self.steps = steps
        self.dropout = dropout > 0
        self.seed = seed
        self.tracer = tracer
        self.streams = Streams(device)
        # One weightless template module per stage kind, bound to a layer's weights per visit.
        self.binders = {kind: model.template(kind) for kind in {p.kind for p in self.plans}}
        self.stash = make_stash(stash, source, self.streams, len(self.plans) - 2,
                                len(self.micro_batches))

    def run_step(self, step: int) -> StepResult:
        t0 = time.perf_counter()
        with self.tracer.span("data", "data"):
            batches = [b.to(self.device) for b in self.sharder.batches(step, self.micro_batches)]
        last = len(self.plans) - 1
        # The last block runs its forward with grad and keeps the graph until its backward,
        # which follows the head's at once: one recompute less per step, one layer's memory.
        keep = last - 1 if last >= 2 else -1
        kept = None
        xs: list = [None] * len(batches)

        for layer in range(last):  # forward, layer-major
            with self.tracer.span(f"F{layer}", "forward"):
                flat = self.source.weights(layer, step)
                self.source.prefetch(layer + 1, step)
                if layer == keep:
                    kept = self._forward_with_graph(step, layer, flat, xs, batches)
                    continue  # its weights stay in use until its backward
                stage = self._bind(layer, flat)
                with torch.no_grad():
                    for i, batch in enumerate(batches):
                        if layer > 0:
                            xs[i] = self.stash.put(layer, i, xs[i])
                        with self._rng(step, layer, i):
                            xs[i] = stage(xs[i], batch)
            self.source.release(layer, step)

        loss, correct = self._backward_visit(step, last, xs, batches,  # head: fwd + bwd
                                             prefetch_next=keep < 0)
        for layer in range(last - 1, -1, -1):  # backward, reverse order
            self._backward_visit(step, layer, xs, batches, kept if layer == keep else None)

        self.source.drain()  # every push acknowledged (a refusal raises here)
        self.stash.clear()
        count = sum(int((b.targets != -100).sum()) for b in batches)
        return StepResult(step, float(loss), int(correct), count,
                          len(batches) * self.sharder.size, time.perf_counter() - t0)

    def _forward_with_graph(self, step: int, layer: int, flat: torch.Tensor, xs: list,
                            batches) -> _Kept:
        """Forward of ``layer`` with grad, keeping inputs, outputs and weight leaves."""
        leaves = [v.requires_grad_() for v in views(flat, self.plans[layer])]
        stage = self.binders[self.plans[layer].kind].bind(leaves)
        kept = _Kept(leaves, [], [])
        for i, batch in enumerate(batches):
            x_in = xs[i].detach().requires_grad_()
            with torch.enable_grad(), self._rng(step, layer, i):
                out = stage(x_in, batch)
            kept.inputs.append(x_in)
            kept.outputs.append(out)
            xs[i] = out.detach()
        return kept

    def _backward_visit(self, step: int, layer: int, dx: list, batches,
                        kept: _Kept | None = None, prefetch_next: bool = True):
        """Recompute ``layer`` per micro-batch with grad (or take its ``kept`` graph),
        back-propagate ``dx`` (replaced in place by the gradient w.r.t. the layer's input),
        accumulate and push the weight gradient. For the head the loss is the output, and
        (loss, correct) is returned."""
        plan = self.plans[layer]
        head = layer == len(self.plans) - 1
        loss_sum = torch.zeros((), device=self.device)
        correct_sum = torch.zeros((), dtype=torch.long, device=self.device)
        with self.tracer.span(f"{'H' if head else 'B'}{layer}", "backward"):
            leaves = kept.leaves if kept else [
                v.requires_grad_() for v in views(self.source.weights(layer, step), plan)]
            scale = self.source.loss_scale(step) if head else 1.0  # fp16 dynamic loss scaling
            if not prefetch_next:
                pass  # the next visit's weights are already held (the kept block)
            elif layer > 0:
                self.source.prefetch(layer - 1, step)
            elif step + 1 < self.steps:
                self.source.prefetch(0, step + 1)  # answered once the EPS has updated layer 0
            stage = self.binders[plan.kind].bind(leaves)
            slot, acc = self.source.grad_buffer(plan)
            acc_views = views(acc, plan)
            for i, batch in enumerate(batches):
                if kept:
                    x_in, out = kept.inputs[i], kept.outputs[i]
                else:
                    if head:
                        x_in = dx[i].detach().requires_grad_()
                    elif layer > 0:
                        x_in = self.stash.pop(layer, i).detach().requires_grad_()
                    else:
                        x_in = None
                    with torch.enable_grad(), self._rng(step, layer, i):
                        out = stage(x_in, batch)
                if head:
                    out, correct = out
                    loss_sum += out.detach()
                    correct_sum += correct
                    if scale != 1.0:
                        out = out * scale
                inputs = leaves if x_in is None else [x_in, *leaves]
                grads = torch.autograd.grad(out, inputs, None if head else dx[i])
                if x_in is not None:
                    dx[i], grads = grads[0], grads[1:]
                if i == 0:
                    torch._foreach_copy_(acc_views, list(grads))
                else:
                    torch._foreach_add_(acc_views, list(grads))
        self.source.release(layer, step)
        self.source.push(step, plan, slot, acc)
        return loss_sum, correct_sum

    def _bind(self, layer: int, flat: torch.Tensor):
        return self.binders[self.plans[layer].kind].bind(views(flat, self.plans[layer]))

    def _rng(self, step: int, layer: int, i: int):
        seed = dropout_seed(self.seed, step, layer, self.micro_batches[i]) if self.dropout else 0
        return seeded(seed, self.device, self.dropout)
