"""The L2L loop of one worker: layer-major forward over u micro-batches, boundary stash,
backward in reverse with recompute, each layer's gradient pushed as soon as it is complete.

Per step t (L layers: pre, blocks, post):

    forward   for l in 0..L-2:  w = weights(l, t); for each micro-batch: stash input, run stage
    head      l = L-1:          forward + backward of the loss per micro-batch, push grad(L-1)
    backward  for l in L-2..0:  w = weights(l, t); for each micro-batch: recompute stage from
                                the stash with grad, back-propagate, accumulate; push grad(l)

While layer l computes, the fetch of the next layer to visit is already in flight (the EPS
answers when that version exists), and pushed gradients are reduced and applied by the EPS while
the worker goes on with the layers below. Dropout masks are seeded by (seed, step, layer, global
micro-batch) in the forward and the recompute alike, so gradients equal plain training's.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from protocol.messages import Welcome
from protocol.tensors import Layout, views

from .config import ModelConfig, WorkerConfig
from .data import Sharder
from .eps_client import EpsClient
from .models.base import LayeredModel, dropout_seed, seeded
from .stash import make_stash
from .transfer import Transfer


@dataclass
class StepResult:
    step: int
    loss: float  # this worker's share of the global mean loss (shares add up across workers)
    correct: int
    count: int  # loss terms (samples or tokens) on this worker
    samples: int
    seconds: float


class Executor:
    def __init__(self, cfg: WorkerConfig, mcfg: ModelConfig, model: LayeredModel, layout: Layout,
                 sharder: Sharder, client: EpsClient, welcome: Welcome, grad_dtype: str):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.layout = layout
        self.plans = layout.layers
        if len(self.plans) < 2:
            raise ValueError("a layered model needs at least two layers (pre ... post)")
        self.sharder = sharder
        self.client = client
        self.grad_dtype = grad_dtype
        # One weightless template module per stage kind, bound to a layer's weights per visit.
        self.binders = {kind: model.template(kind) for kind in {p.kind for p in self.plans}}
        self.transfer = Transfer(welcome, layout, self.device, cfg.transport, grad_dtype)
        self.stash = make_stash(cfg.stash)
        self.dropout = mcfg.dropout > 0
        self.seed = mcfg.seed
        self.micro_batches = list(cfg.my_micro_batches())
        self._fetches: dict[tuple[int, int], Future] = {}
        self._pushes: list[Future] = []

    # ------------------------------------------------------------------------- weights

    def _prefetch(self, layer: int, version: int) -> None:
        key = (layer, version)
        if key not in self._fetches:
            self._fetches[key] = self.client.fetch(layer, version)

    def _weights(self, layer: int, version: int) -> torch.Tensor:
        self._prefetch(layer, version)
        ready, frames = self.client.wait(self._fetches.pop((layer, version)))
        if ready.version != version:
            raise RuntimeError(f"layer {layer}: got version {ready.version}, need {version}")
        return self.transfer.weights(self.plans[layer], ready, frames)

    # ------------------------------------------------------------------------- step

    def run_step(self, step: int) -> StepResult:
        t0 = time.perf_counter()
        batches = [b.to(self.device) for b in self.sharder.batches(step, self.micro_batches)]
        last = len(self.plans) - 1
        xs: list = [None] * len(batches)

        for layer in range(last):  # forward, layer-major
            self._prefetch(layer + 1, step)
            stage = self._bind(layer, self._weights(layer, step))
            with torch.no_grad():
                for i, batch in enumerate(batches):
                    if layer > 0:
                        self.stash.put(layer, i, xs[i])
                    with self._rng(step, layer, i):
                        xs[i] = stage(xs[i], batch)

        self._prefetch(last - 1, step)
        loss, correct = self._backward_visit(step, last, xs, batches)  # head: fwd + bwd

        for layer in range(last - 1, -1, -1):  # backward, reverse order
            if layer > 0:
                self._prefetch(layer - 1, step)
            elif step + 1 < self.cfg.steps:
                self._prefetch(0, step + 1)  # answered once the EPS has updated layer 0
            self._backward_visit(step, layer, xs, batches)

        for fut in self._pushes:  # surface any refused push before reporting the step
            self.client.wait(fut)
        self._pushes.clear()
        self.stash.clear()
        count = sum(int((b.targets != -100).sum()) for b in batches)
        return StepResult(step, float(loss), int(correct), count,
                          len(batches) * self.sharder.size, time.perf_counter() - t0)

    def _backward_visit(self, step: int, layer: int, dx: list, batches):
        """Recompute layer ``layer`` per micro-batch with grad, back-propagate ``dx`` (replaced
        in place by the gradient w.r.t. the layer's input), accumulate and push the weight
        gradient. For the head, the loss is the output and (loss, correct) is returned."""
        plan = self.plans[layer]
        head = layer == len(self.plans) - 1
        leaves = [v.requires_grad_() for v in views(self._weights(layer, step), plan)]
        stage = self.binders[plan.kind].bind(leaves)
        slot = self._acquire_slot()
        acc = self.transfer.grad_buffer(slot, plan)
        acc_views = views(acc, plan)
        loss_sum = torch.zeros((), device=self.device)
        correct_sum = torch.zeros((), dtype=torch.long, device=self.device)
        for i, batch in enumerate(batches):
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
                grad_out = None
            else:
                grad_out = dx[i]
            inputs = leaves if x_in is None else [x_in, *leaves]
            grads = torch.autograd.grad(out, inputs, grad_out)
            if x_in is not None:
                dx[i], grads = grads[0], grads[1:]
            if i == 0:
                torch._foreach_copy_(acc_views, list(grads))
            else:
                torch._foreach_add_(acc_views, list(grads))
        self.transfer.zero_gaps(acc, plan)
        self._push(step, layer, slot, acc)
        return loss_sum, correct_sum

    # ------------------------------------------------------------------------- helpers

    def _bind(self, layer: int, flat: torch.Tensor):
        return self.binders[self.plans[layer].kind].bind(views(flat, self.plans[layer]))

    def _rng(self, step: int, layer: int, i: int):
        seed = dropout_seed(self.seed, step, layer, self.micro_batches[i]) if self.dropout else 0
        return seeded(seed, self.device, self.dropout)

    def _acquire_slot(self) -> int:
        self._raise_failed_pushes()
        return self.transfer.acquire_slot(self.cfg.eps_timeout)

    def _push(self, step: int, layer: int, slot: int, acc: torch.Tensor) -> None:
        data = self.transfer.outgoing(slot, self.plans[layer], acc)
        fut = self.client.push_grad(step=step, layer=layer, rank=self.cfg.rank,
                                    slot=-1 if data is not None else slot,
                                    dtype=self.grad_dtype, data=data)
        fut.add_done_callback(lambda _f, s=slot: self.transfer.release_slot(s))
        self._pushes.append(fut)

    def _raise_failed_pushes(self) -> None:
        for fut in self._pushes:
            if fut.done() and fut.exception() is not None:
                raise fut.exception()

    def close(self) -> None:
        for fut in self._fetches.values():
            fut.cancel()
        self._fetches.clear()
        self.transfer.close()
