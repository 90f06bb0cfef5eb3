"""The L2L loop of one worker: layer-major forward over u micro-batches, boundary stash,
backward in reverse with recompute, each layer's gradient pushed as soon as it is complete.

Per step t (L layers: pre, blocks, post):

    forward   for l in 0..L-2:  w = weights(l, t); for each micro-batch: stash input, run stage
                                (the last block, L-2, and as many blocks before it as the
                                activation budget holds, run with grad and keep their graphs)
    head      l = L-1:          forward + backward of the loss per micro-batch, push grad(L-1)
    backward  for l in L-2..lo: w = weights(l, t); for each micro-batch: recompute stage from
                                the stash with grad (or use the kept graph), back-propagate,
                                accumulate; push grad(l)   (lo: the lowest layer that trains,
                                0 but for a frozen bottom; the layers below it push skips)

Every visit takes its weights, then asks its layer source for the *next* visit's
(``prefetch``), so fetching overlaps compute and at most two layers are in flight; pushes are
asynchronous and the EPS reduces and updates a layer while the worker computes the layers
below. Dropout masks are seeded by (seed, step, layer, global micro-batch) in the forward and
the recompute alike, so gradients equal plain training's.

Boundaries may be tuples of tensors (stash.members). A tensor a layer reads from an earlier
layer (a tie) is copied when its owner is visited in the forward pass; the reader's gradient of
it is summed in fp32 and added into the owner's gradient before the owner is pushed.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from protocol.tensors import Layout, named_views
from protocol.trace import NULL, Tracer

from .data import Sharder
from .evaluation import Evaluation
from .faults import Fault
from .heap import heap_trimmer
from .keep import GraphBudget, Kept, SavedBytes, graph_bytes
from .models.base import LayeredModel, derive_seed, dropout_seed, seeded
from .regions import trained
from .stash import make_stash, members, shaped_like
from .streams import Streams


@dataclass
class StepResult:
    step: int
    loss: float  # this worker's share of the global mean loss (shares add up across workers)
    correct: int
    count: int  # loss terms (samples or tokens) on this worker
    samples: int
    seconds: float
    fetch_wait: float = 0.0  # seconds blocked waiting for weights (the rest of the EPS's lag)
    push_wait: float = 0.0  # seconds blocked on gradient slots and the step's push acks
    norm: float = 0.0  # loss terms in the global minibatch (what the shares are divided by)

    @property
    def mean_loss(self) -> float:
        """This worker's own mean loss: its share, scaled from the global minibatch's terms
        to its own (with one worker, the share itself)."""
        return self.loss * self.norm / self.count if self.count and self.norm else self.loss


class Executor(Evaluation):
    def __init__(self, model: LayeredModel, layout: Layout, source, sharder: Sharder, *,
                 device: torch.device, micro_batches: range, steps: int, dropout: float,
                 seed: int, stash: str = "device", tracer: Tracer = NULL,
                 layer_drop: float = 0.0, fault: Fault | None = None,
                 cuda_delays: dict[str, int] | None = None, budget: GraphBudget | None = None):
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
        self.layer_drop = layer_drop
        self.tracer = tracer
        self.fault = fault
        self.waited = {"fetch": 0.0, "push": 0.0}  # this step's blocking waits (seconds)
        self.streams = Streams(device, cuda_delays)
        # One weightless template module per stage kind, bound to a layer's weights per visit.
        self.binders = {kind: model.template(kind, device) for kind in {p.kind for p in self.plans}}
        self.stash = make_stash(stash, source, self.streams, len(self.plans) - 2,
                                len(self.micro_batches))
        self.heap = heap_trimmer(device.type, stash)
        self.budget = budget or GraphBudget(0, device)  # graphs kept under the budget
        self.trained = trained(self.plans)  # what gets a weight gradient (--freeze)
        # The lowest layer with a weight gradient (its own, or a tie's): the backward stops
        # there; the layers below it (a frozen embedding, LoRA's blocks left out) have nothing
        # to learn, their inputs are not stashed and they are pushed as skips after the forward.
        self.lowest = min((i for i, (_, _, names) in enumerate(self.trained) if names),
                          default=len(self.plans) - 1)
        # Ties: owner layer -> its tensors read elsewhere; their values and readers' gradients.
        self.shared: dict[int, set[str]] = {}
        for plan in self.plans:
            for tie in plan.ties:
                self.shared.setdefault(tie.owner, set()).add(tie.tensor)
        self.tied: dict[tuple[int, str], torch.Tensor] = {}
        self.tie_grads: dict[tuple[int, str], torch.Tensor] = {}
        if layer_drop and any(0 < owner < len(self.plans) - 1 for owner in self.shared):
            raise ValueError("LayerDrop may skip a block whose tensor another layer reads "
                             "(a tie owned by a block): not supported")

    def run_step(self, step: int, pushed: frozenset[int] = frozenset()) -> StepResult:
        """Run ``step``: the forward loop, then the backward loop. ``pushed``: layers whose
        gradient the EPS already has from this rank (a replacement redoing the step its
        predecessor died in): they are computed through, for the layers below, but not pushed
        again."""
        t0 = time.perf_counter()
        self.waited = {"fetch": 0.0, "push": 0.0}
        if pushed:
            self.source.redo(step, pushed)
        with self.tracer.span("data", "data"):
            batches = [b.to(self.device) for b in self.sharder.batches(step, self.micro_batches)]
        for buf in self.tie_grads.values():
            buf.zero_()
        skipped = self.skipped(step)
        for layer in sorted(skipped - pushed):  # LayerDrop: neither fetched nor pushed
            self.source.skip(step, self.plans[layer])
        visits = [i for i in range(len(self.plans)) if i not in skipped]
        xs, graphs = self._forward(step, visits, batches)
        for layer in visits:  # (their next version needs no more from this step)
            if layer < self.lowest and layer not in pushed:
                self.source.skip(step, self.plans[layer])
        loss, correct = self._backward(step, visits, xs, batches, graphs, pushed)
        with self._waiting("push"):
            self.source.drain()  # every push acknowledged (a refusal raises here)
        self.stash.clear()
        self.tied.clear()
        self.budget.step_done()  # after the first step with a kept block: how many fit
        count = sum(int((b.targets != -100).sum()) for b in batches)
        return StepResult(step, float(loss), int(correct), count,
                          len(batches) * self.sharder.size, time.perf_counter() - t0,
                          self.waited["fetch"], self.waited["push"],
                          float(batches[0].norm) if batches else 0.0)

    def _forward(self, step: int, visits: list[int], batches) -> tuple[list, dict[int, Kept]]:
        """The first loop: each layer but the head, once, over all u micro-batches. A layer's
        input is stashed for the recompute, or (the last blocks, keep.py) its whole graph is
        kept for its backward. Returns the last outputs (the head's inputs) and kept graphs."""
        held, cloned = self.budget.kept(visits[:1] + [v for v in visits[1:] if v >= self.lowest])
        self.budget.most = max(self.budget.most, (held >= 0) + len(cloned))
        xs: list = [None] * len(batches)
        graphs: dict[int, Kept] = {}
        for k, layer in enumerate(visits[:-1]):
            self.point(step, f"F{layer}")
            with self.tracer.span(f"F{layer}", "forward"):
                keep = layer == held or layer in cloned
                weights = self._weights(layer, step, requires_grad=keep, copy=layer in cloned)
                self.source.prefetch(visits[k + 1], step)
                if keep:
                    graphs[layer] = self._forward_with_graph(step, layer, weights, xs, batches,
                                                             cloned=layer in cloned)
                    if layer == held:
                        continue  # its weights stay in use until its backward, right after
                else:
                    stage = self.binders[self.plans[layer].kind].bind(weights)
                    with torch.no_grad():
                        for i, batch in enumerate(batches):
                            if layer > 0 and layer >= self.lowest:
                                xs[i] = self.stash.put(layer, i, xs[i])
                            with self._rng(step, layer, i):
                                xs[i] = stage(xs[i], batch)
            self.source.release(layer, step)
        return xs, graphs

    def _backward(self, step: int, visits: list[int], xs: list, batches,
                  graphs: dict[int, Kept], pushed: frozenset[int]):
        """The second loop: the head (the loss's forward and backward), then every layer in
        reverse over all u micro-batches, from its kept graph or recomputed from the stash;
        each visit prefetches the next one that needs weights (layer 0: the next step's),
        but the head does not while the last block's weights are still held. Returns the
        summed (loss, correct)."""
        order = [v for v in visits[::-1] if v >= self.lowest]
        head_sums = None
        for j, layer in enumerate(order):
            fetching = next((v for v in order[j + 1:] if v not in graphs), None)
            after = (fetching, step) if fetching is not None else (
                (0, step + 1) if step + 1 < self.steps else None)
            if j == 0 and any(not g.cloned for g in graphs.values()):
                after = None
            sums = self._backward_visit(step, layer, xs, batches, graphs.pop(layer, None),
                                        prefetch=after, push=layer not in pushed)
            head_sums = head_sums or sums
        return head_sums

    @contextlib.contextmanager
    def _waiting(self, what: str):
        """Count the time a blocking call of the source takes (two clock reads per call)."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.waited[what] += time.perf_counter() - t

    def _weights(self, layer: int, step: int, requires_grad: bool,
                 copy: bool = False) -> dict[str, torch.Tensor]:
        """The visit's tensors by name: views of the layer's flat weights (``copy``: private
        copies, so the layer's buffer can go back), and its tied tensors (copied when their
        owner was visited in the forward pass)."""
        plan = self.plans[layer]
        with self._waiting("fetch"):
            flat = self.source.weights(layer, step)
        if copy:
            flat = flat.clone()
        named = named_views(flat, plan)
        for name in self.shared.get(layer, ()):
            if (layer, name) not in self.tied:
                self.tied[layer, name] = named[name].detach().clone()
        for tie in plan.ties:
            named[tie.name] = self.tied[tie.owner, tie.tensor]
        if requires_grad:  # (a frozen tensor: back-propagated through, no gradient)
            named = {n: t.detach().requires_grad_(n in self.trained[layer][2])
                     for n, t in named.items()}
        return named

    def _forward_with_graph(self, step: int, layer: int, leaves: dict, xs: list,
                            batches, cloned: bool) -> Kept:
        """Forward of ``layer`` with grad, keeping inputs, outputs and weight leaves (the
        first time, counting the bytes the graph holds)."""
        plan = self.plans[layer]
        stage = self.binders[plan.kind].bind(leaves)
        kept = Kept(leaves, cloned=cloned)
        saved = SavedBytes() if self.budget.measuring() else None
        with saved.hooks() if saved else contextlib.nullcontext():
            for i, batch in enumerate(batches):
                x_in = _grad_inputs(xs[i])
                with torch.enable_grad(), self._rng(step, layer, i):
                    out = stage(x_in, batch)
                kept.inputs.append(x_in)
                kept.outputs.append(out)
                xs[i] = shaped_like(out, [t.detach() for t in members(out)])
        if saved is not None:
            self.budget.measured = graph_bytes(kept, saved,
                                               [leaves[t.name] for t in plan.tensors])
        return kept

    def _backward_visit(self, step: int, layer: int, dx: list, batches,
                        kept: Kept | None = None, prefetch: tuple[int, int] | None = None,
                        push: bool = True):
        """Recompute ``layer`` per micro-batch with grad (or take its ``kept`` graph),
        back-propagate ``dx`` (replaced in place by the gradient w.r.t. the layer's input),
        accumulate and push the weight gradient (unless not ``push``: then it is not even
        computed, but tied tensors' gradients are). For the head the loss is the output, and
        (loss, correct) is returned."""
        plan = self.plans[layer]
        head = layer == len(self.plans) - 1
        sums = (torch.zeros((), device=self.device),
                torch.zeros((), dtype=torch.long, device=self.device))
        self.point(step, f"{'H' if head else 'B'}{layer}")
        with self.tracer.span(f"{'H' if head else 'B'}{layer}", "backward"):
            leaves = kept.leaves if kept else self._weights(layer, step, requires_grad=True)
            scale = self.source.loss_scale(step) if head else 1.0  # fp16 dynamic loss scaling
            if prefetch is not None:  # layer 0 of the next step: once the EPS has updated it
                self.source.prefetch(*prefetch)
            stage = self.binders[plan.kind].bind(leaves)
            with self._waiting("push"):
                slot, acc = self.source.grad_buffer(plan) if push else (-1, None)
            own, ties, _ = self.trained[layer]
            targets = list(named_views(acc, plan, own).values()) if push else []
            tie_targets = self._tie_grads(ties)
            weights = ([leaves[n] for n in own] if push else []) + [leaves[t.name] for t in ties]
            # the visit after this one in this step (its first stash entry is fetched early)
            after_this = prefetch[0] if prefetch is not None and prefetch[1] == step else -1
            for i, batch in enumerate(batches):
                if not weights and layer == 0:
                    break  # already pushed, no input to differentiate: nothing to compute
                if kept:
                    x_in, out = kept.inputs[i], kept.outputs[i]
                else:
                    x_in = (_grad_inputs(dx[i]) if head else
                            _grad_inputs(self.stash.pop(layer, i)) if layer > 0 else None)
                    with torch.enable_grad(), self._rng(step, layer, i):
                        out = stage(x_in, batch)
                # the next stashed input comes back to the device while this one computes
                self.stash.fetch(*((layer, i + 1) if i + 1 < len(batches) else (after_this, 0)))
                if head:
                    out, correct = out
                    sums[0].add_(out.detach())
                    sums[1].add_(correct)
                    outputs, grad_out = [out * scale if scale != 1.0 else out], None
                else:
                    pairs = [(o, g) for o, g in zip(members(out), members(dx[i]))
                             if g is not None and o.requires_grad]
                    outputs, grad_out = [o for o, _ in pairs], [g for _, g in pairs]
                self._accumulate(outputs, grad_out, x_in, weights, dx, i, targets, tie_targets)
            if push:
                self._add_tie_grads(layer, acc)
        if not (kept and kept.cloned):  # a kept copy's buffer went back in the forward
            self.source.release(layer, step)
        if push:
            self.source.push(step, plan, slot, acc)
        return sums

    def _accumulate(self, outputs, grad_out, x_in, weights, dx: list, i: int, targets,
                    tie_targets) -> None:
        """Back-propagate one micro-batch: ``dx[i]`` becomes the gradient w.r.t. the input,
        the weights' gradients go into ``targets`` (the first micro-batch copies, the others
        add; none: already pushed), the tied tensors' into their fp32 buffers."""
        x_parts = [] if x_in is None else [t for t in members(x_in) if t.requires_grad]
        grads = torch.autograd.grad(outputs, [*x_parts, *weights], grad_out,
                                    allow_unused=True, materialize_grads=True)
        if x_in is not None:
            it = iter(grads[:len(x_parts)])
            dx[i] = shaped_like(x_in, [next(it) if t.requires_grad else None
                                       for t in members(x_in)])
        grads = grads[len(x_parts):]
        own = list(grads[:len(targets)])
        if not targets:
            pass  # already pushed
        elif i == 0:
            torch._foreach_copy_(targets, own)
        else:
            torch._foreach_add_(targets, own)
        for buf, g in zip(tie_targets, grads[len(targets):]):
            buf.add_(g)  # several readers (or tensors) may share one buffer

    def point(self, step: int, point: str) -> None:
        """The loop reached ``point`` of ``step`` (a visit starts; P: its pushes are in; E: it
        is reported): it made progress (its heartbeats go on), and --fault fires there."""
        self.heap.tick()
        self.source.tick()
        self.streams.stall("compute")  # testing (--cuda-delay): the visit's kernels run late
        if self.fault is not None:
            self.fault.at(step, point)

    def skipped(self, step: int) -> set[int]:
        return layer_drop(self.seed, step, len(self.plans), self.layer_drop)

    def _tie_grads(self, ties) -> list[torch.Tensor]:
        """fp32 accumulators of tied tensors' gradients (per owner's tensor; every reader)."""
        out = []
        for tie in ties:
            key = (tie.owner, tie.tensor)
            if key not in self.tie_grads:
                self.tie_grads[key] = torch.zeros(tie.shape, dtype=torch.float32,
                                                  device=self.device)
            out.append(self.tie_grads[key])
        return out

    def _add_tie_grads(self, layer: int, acc: torch.Tensor) -> None:
        """The owner's gradient also holds what its readers contributed (visited before it)."""
        if layer in self.shared:
            names = self.shared[layer] & self.trained[layer][2]
            for name, view in named_views(acc, self.plans[layer], names).items():
                view.add_(self.tie_grads[layer, name])

    def _rng(self, step: int, layer: int, i: int):
        seed = dropout_seed(self.seed, step, layer, self.micro_batches[i]) if self.dropout else 0
        return seeded(seed, self.device, self.dropout)


def layer_drop(seed: int, step: int, layers: int, p: float) -> set[int]:
    """The blocks LayerDrop skips in ``step``: a pure function of (seed, step), the same on
    every worker; pre and post (the first and last layer) always run."""
    if not p:
        return set()
    return {i for i in range(1, layers - 1)
            if derive_seed(seed, "layerdrop", step, i) / 2.0 ** 63 < p}


def _grad_inputs(x):
    """A boundary as fresh autograd leaves (floating members require grad)."""
    return shaped_like(x, [t.detach().requires_grad_() if t.is_floating_point() else t
                           for t in members(x)])
