"""The EPS's math owners: one engine thread per shard of layers (layer l belongs to engine
l % n), as BytePS runs one engine per key; the work of each job runs in pieces on the math
pool, so a layer alone still has every core (pool.py).

An engine alone reads and writes its layers' math state (optimizer, master, compute copy; the
gradient parts its jobs read). The core sends it typed jobs and gets each one back as a
``Done`` with a typed result; an engine runs its jobs in the order they were sent (one layer's
jobs never overlap), and engines run in parallel. The core never touches this state, and an
engine never touches the core's bookkeeping (versions, claims, peers). A checkpoint, which
reads every layer, runs while the other engines are parked.

``inline=True`` runs each job in the caller's thread at once (tests drive the core that way,
deterministically); results still arrive through ``on_done``.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from protocol.trace import NULL, Tracer

from .boxes import CrossBox
from .buffers import BufferPool
from .config import OptimizerConfig
from .jobs import Action, Done, Exclusive, Init, Resolve, Update, Updated, Verdict
from .layer_math import FP16_OVERFLOW, Checked, LayerMath, all_finite, largest
from .layer_store import LayerStore
from .optimizers import make_optimizer
from .pool import MathPool

log = logging.getLogger("eps_server")

# Engines only order jobs and wait for the pool; beyond a few, more layers in flight at once
# add nothing the pool does not already have.
MAX_ENGINES = 8


def layer_maths(store: LayerStore, cfg: OptimizerConfig, pool: MathPool,
                buffers: BufferPool) -> list[LayerMath]:
    """Every layer's optimizer (state created explicitly, zero) and passes; in shard mode,
    over this box's span of each layer."""
    maths = []
    for plan, (lo, _) in zip(store.shard_plans, store.spans):
        compute = (store.compute_shard(plan.index) if store.compute_region is not None
                   else None)
        optimizer = make_optimizer(plan, store.master(plan.index), compute, cfg, pool=pool,
                                   buffers=buffers)
        optimizer.base = lo  # the span's first element in the layer (bf16 rounding noise)
        maths.append(LayerMath(plan, optimizer, pool, buffers))
    return maths


# ----------------------------------------------------------------------------- engines


@dataclass
class _Park:
    gate: threading.Barrier
    release: threading.Event = field(default_factory=threading.Event)


class Engines:
    def __init__(self, store: LayerStore, layers: list[LayerMath], n: int,
                 on_done: Callable[[Done], None], *, inline: bool = False,
                 tracer: Tracer = NULL):
        self.store, self.layers, self.on_done, self.tracer = store, layers, on_done, tracer
        self.n = 1 if inline else max(1, min(n, len(layers), MAX_ENGINES))
        self.inline = inline
        self.boxes: CrossBox | None = None  # several boxes: reduce across them first
        self._stopping = False
        self._parks: list[_Park] = []  # exclusive jobs under way (released on close)
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(self.n)]
        self._run_job = {Init: self._init, Update: self._update, Resolve: self._resolve,
                         Exclusive: self._exclusive}
        self._threads = [] if inline else [
            threading.Thread(target=self._run, args=(k,), name=f"eps-engine-{k}", daemon=True)
            for k in range(self.n)]
        for t in self._threads:
            t.start()

    def submit(self, job) -> None:
        """Queue ``job`` on the engine owning its layer."""
        if self.inline:
            self.on_done(self._execute(job))
        else:
            self._queues[job.layer % self.n].put(job)

    def exclusive(self, job: Exclusive) -> None:
        """Run ``job`` on engine 0 once every other engine has parked behind its queue."""
        if self.inline or self.n == 1:
            return self.submit_to(0, job)
        park = _Park(threading.Barrier(self.n))
        self._parks = [p for p in self._parks if not p.release.is_set()] + [park]
        for k in range(1, self.n):
            self._queues[k].put(park)
        self._queues[0].put((park, job))

    def submit_to(self, engine: int, job) -> None:
        if self.inline:
            self.on_done(self._execute(job))
        else:
            self._queues[engine].put(job)

    def close(self) -> None:
        """Stop: a running job finishes, queued ones are dropped (idempotent)."""
        self._stopping = True
        for park in self._parks:  # nobody waits for an exclusive job that will not run
            park.gate.abort()
            park.release.set()
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join()
        self._threads = []

    def _run(self, k: int) -> None:
        q = self._queues[k]
        while True:
            item = q.get()
            if item is None:
                return
            if isinstance(item, _Park):  # another engine runs an exclusive job
                try:
                    item.gate.wait()
                except threading.BrokenBarrierError:  # stopping
                    continue
                item.release.wait()
                continue
            if self._stopping:
                continue
            if isinstance(item, tuple):  # (park, exclusive job): wait for the others first
                park, job = item
                try:
                    park.gate.wait()
                except threading.BrokenBarrierError:  # stopping
                    continue
                try:
                    done = self._execute(job)
                finally:
                    park.release.set()
            else:
                done = self._execute(item)
            self.on_done(done)

    def _execute(self, job) -> Done:
        t0 = time.perf_counter()
        try:
            result = self._run_job[type(job)](job)
        except Exception as e:  # reported to the core, which decides what it means
            if not (isinstance(job, Exclusive) and isinstance(e, OSError)):  # a full disk, ...
                log.exception("engine job %s failed", type(job).__name__)
            return Done(job, error=e, seconds=time.perf_counter() - t0)
        return Done(job, result, seconds=time.perf_counter() - t0)

    # -- the jobs -------------------------------------------------------------------------

    def _init(self, job: Init) -> str:
        """Writes the layer's initial values; returns why they are refused ("" if not)."""
        big = largest(job.data)  # (one pass: NaN or inf where an element is)
        if not math.isfinite(big) or (job.tail is not None and not all_finite(job.tail)):
            return "are not all finite"
        if self.store.compute_dtype == "float16" and big >= FP16_OVERFLOW:
            return (f"reach {big:.6g}, beyond float16's range (65504): --precision fp16 cannot "
                    "serve them (bf16 can)")
        self.store.write_initial(job.layer, job.data, job.tail)
        return ""

    def _update(self, job: Update) -> Updated:
        if self.boxes is None:
            return self._update_parts(job, tuple(p.src for p in job.parts))
        if self.store.sharding is not None:
            return self._update_shard(job)
        math_ = self.layers[job.layer]  # several boxes: the layer's sum over every box's ranks
        summed = math_.summed(tuple(p.src for p in job.parts))
        try:
            with self.tracer.span(f"boxes L{job.layer}", "reduce"):
                self.boxes.reduce(job.layer, job.t, summed)
            checked = math_.check((summed,))
            self._nonfinite_stops(job, checked)
            checked = Checked((), checked.overflow or bool(checked.refused), checked.norm_sq)
            return self._update_parts(job, (summed,), checked)
        finally:
            math_.release(summed)

    def _update_shard(self, job: Update) -> Updated:
        """Shard mode: the boxes' sum reduce-scattered, this box's chunk checked and updated
        (the boxes decide from the whole layer), the served copy all-gathered."""
        math_, numel = self.layers[job.layer], self.store.plan(job.layer).trainable
        sharding, (lo, hi) = self.store.sharding, self.store.spans[job.layer]
        summed = math_.summed(tuple(p.src for p in job.parts), numel, sharding.padded(numel))
        chunk = self._buffers.take(sharding.chunk(numel))
        mine = chunk[:hi - lo]
        try:
            with self.tracer.span(f"boxes L{job.layer}", "reduce"):
                checked = self.boxes.reduce_shard(job.layer, job.t, summed, chunk,
                                                  lambda: math_.check((mine,)))
            math_.release(summed)
            summed = None
            self._nonfinite_stops(job, checked)
            updated = self._update_parts(job, (mine,), checked)
            if updated.rewritten:
                self._gather(job.layer)
            return updated
        finally:
            math_.release(summed)
            self._buffers.give(chunk)

    @property
    def _buffers(self) -> BufferPool:
        return self.layers[0].buffers  # the one pool every layer's math takes from

    def _gather(self, layer: int) -> None:
        """Shard mode: every box's chunk of the layer's served copy, into the whole copy."""
        sharding, numel = self.store.sharding, self.store.plan(layer).trainable
        served = self.store.compute(layer)[:numel]  # (frozen tensors after it never change)
        lo, hi = self.store.spans[layer]
        mine = self._buffers.take(sharding.chunk(numel), served.dtype)
        out = self._buffers.take(sharding.padded(numel), served.dtype)
        try:
            mine[:hi - lo].copy_(served[lo:hi])
            with self.tracer.span(f"gather L{layer}", "reduce"):
                self.boxes.gather(layer % self.n, layer, mine, out)
            served.copy_(out[:numel])
        finally:
            self._buffers.give(mine)
            self._buffers.give(out)

    def _nonfinite_stops(self, job: Update, checked: Checked) -> None:
        """Several boxes: after the sum no rank can be told to push again, and every box found
        the same; unless fp16's loss scaling skips the step, the job stops on every box."""
        if not checked.finite and not job.skips_overflow:
            raise self.boxes.fail(f"a non-finite gradient of layer {job.layer} at step {job.t} "
                                  "(from a rank of this box or of another): no box can apply "
                                  "the step")

    def _update_parts(self, job: Update, parts: tuple[torch.Tensor, ...],
                      checked: Checked | None = None) -> Updated:
        math_ = self.layers[job.layer]
        t0 = time.perf_counter()
        if checked is None:  # (several boxes: checked after the boxes' sum)
            with self.tracer.span(f"check L{job.layer}", "reduce"):
                checked = math_.check(parts)
        check_seconds = time.perf_counter() - t0
        if job.norms is not None and not checked.finite:
            job.norms.record(job.layer, checked.norm_sq)  # the layers below hold
        if not checked.finite:  # nothing is written: refused, or the step is skipped
            return Updated(checked, False, None, check_seconds)
        action = job.action
        if action is Action.SPECULATE and not job.norms.guess(job.layer, checked.norm_sq,
                                                                lambda: self._stopping):
            action = Action.HOLD
        if action is Action.HOLD:
            with self.tracer.span(f"keep L{job.layer}", "reduce"):
                return Updated(checked, False, math_.keep(parts), check_seconds)
        with self.tracer.span(f"update L{job.layer}", "update"):
            self.store.retain(job.layer)
            kept = math_.update(parts, job.t, job.grad_scale, job.cfg,
                                keep=action is Action.SPECULATE)
        return Updated(checked, True, kept, check_seconds)

    def _resolve(self, job: Resolve) -> None:
        math_ = self.layers[job.layer]
        try:
            with self.tracer.span(f"{job.verdict.value} L{job.layer}", "update"):
                if job.verdict is Verdict.APPLY:
                    self.store.retain(job.layer)
                else:
                    math_.undo(job.kept, job.t, job.spec_scale, job.cfg)
                if job.verdict is not Verdict.UNDO:
                    math_.apply(job.kept, job.t, job.grad_scale, job.cfg)
        finally:
            math_.release(job.kept)
        if self.boxes is not None and self.store.sharding is not None:
            self._gather(job.layer)

    def _exclusive(self, job: Exclusive):
        with self.tracer.span(job.what, "checkpoint"):
            return job.fn()
