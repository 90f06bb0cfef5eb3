"""The EPS's math owners: one engine thread per shard of layers (layer l belongs to engine
l % n), as BytePS runs one engine per key.

An engine alone reads and writes its layers' math state: the fp32 gradient accumulator and the
optimizer (and through it the layer's master and compute copy). The core sends it typed jobs
and gets each job's result back as a ``Done``; an engine runs its jobs in the order they were
sent (so one layer's reductions and update never overlap), and engines run in parallel. The
core never touches this state, and an engine never touches the core's bookkeeping (versions,
claims, peers). A checkpoint, which reads every layer, runs while the other engines are parked.

``inline=True`` runs each job in the caller's thread at once (tests drive the core that way,
deterministically); results still arrive through ``on_done``.
"""

from __future__ import annotations

import enum
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from protocol.trace import NULL, Tracer

from .config import OptimizerConfig
from .layer_store import LayerStore
from .optimizers import CHUNK, LayerOptimizer, make_optimizer
from .threads import MAX_ENGINES, ThreadBudget
from .updater import LayerStats, clip_coefficient

log = logging.getLogger("eps_server")


def all_finite(t: torch.Tensor) -> bool:
    """True if every element is finite: then so are the smallest and the largest (min and max
    propagate NaN). One vectorized pass, exact, nothing to overflow; a float64 sum, which is
    not vectorized, took 5x as long as the AdamW update it guarded."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


NORM_ROW = 4096
TINY_NORM = 1e-15  # below: squares of fp32 elements may have underflowed to zero


def norm2(t: torch.Tensor) -> float:
    """The L2 norm of a flat tensor: fp32 norms of rows of NORM_ROW elements (vectorized),
    combined in float64: within a few 1e-8 of the float64 norm at the speed of an fp32 one
    (one fp32 norm over a 12.6M-element layer was off by 5e-4; a float64 one takes 20x as
    long). In float64 throughout where that is not finite (so inf/NaN means an element is,
    never that squares overflowed fp32) or so small that fp32 squares may have underflowed."""
    m = t.numel() // NORM_ROW * NORM_ROW
    rows = torch.linalg.vector_norm(t[:m].view(-1, NORM_ROW), dim=1, dtype=torch.float32)
    n = math.sqrt(float(rows.double().square().sum())
                  + float(torch.linalg.vector_norm(t[m:], dtype=torch.float64)) ** 2)
    return n if TINY_NORM < n < math.inf else float(torch.linalg.vector_norm(
        t, dtype=torch.float64))


# ----------------------------------------------------------------------------- jobs


class Reduced(enum.Enum):
    OK = "ok"
    REFUSED = "refused"  # the gradient is not finite: nothing was added
    OVERFLOW = "overflow"  # added, and the sum is not finite: the layer cannot be updated


@dataclass(frozen=True)
class Init:
    """Write a layer's initial fp32 values (refused if not all finite). Result: bool."""

    layer: int
    data: torch.Tensor
    ticket: Any = None


@dataclass(frozen=True)
class Reduce:
    """Add one worker's gradient into the layer's accumulator (the first one is copied).
    Result: a ``Reduced``."""

    layer: int
    rank: int
    src: torch.Tensor
    check_finite: bool
    ticket: Any = None


@dataclass(frozen=True)
class Update:
    """Eager: update the layer from its reduced gradient (clipped by its own norm), then
    reset the accumulator. Result: False if the gradient overflowed and the update was skipped."""

    layer: int
    t: int
    loss_scale: float
    check_finite: bool
    cfg: OptimizerConfig


@dataclass(frozen=True)
class Measure:
    """Deferred: finiteness and squared norm of the reduced gradient. Result: LayerStats."""

    layer: int
    t: int


@dataclass(frozen=True)
class Apply:
    """Deferred: update with a given gradient divisor (``None``: skip), reset the accumulator."""

    layer: int
    t: int
    divisor: float | None
    cfg: OptimizerConfig


@dataclass(frozen=True)
class Exclusive:
    """Run ``fn()`` while no other engine runs anything (checkpoints). Result: its return."""

    fn: Callable[[], Any]
    what: str
    ticket: Any = None


@dataclass
class Done:
    job: Any
    result: Any = None
    error: BaseException | None = None
    seconds: float = 0.0


# ----------------------------------------------------------------------------- layer math


@dataclass
class LayerMath:
    """One layer's math state, owned by one engine."""

    optimizer: LayerOptimizer
    grad: torch.Tensor
    added: int = 0  # gradients in the accumulator this step

    def reduce(self, src: torch.Tensor, check_finite: bool) -> Reduced:
        """Add ``src``. With ``check_finite``, a non-finite gradient is refused (nothing added)
        and the sum is checked as it is made: the add runs chunk by chunk and each chunk is
        checked while it is still in cache (finite gradients can overflow together)."""
        if src.numel() != self.grad.numel():  # a short chunk would broadcast, not fail
            raise ValueError(f"gradient of {src.numel()} elements for a layer of "
                             f"{self.grad.numel()}")
        if check_finite and not all_finite(src):
            return Reduced.REFUSED
        if self.added == 0:
            self.grad.copy_(src)
        else:  # by chunks also because adding a bf16/fp16 tensor whole converts it into a
            finite = True  # fresh fp32 temporary first (4x as long, page faults included)
            for lo in range(0, self.grad.numel(), CHUNK):
                part = self.grad[lo:lo + CHUNK]
                part.add_(src[lo:lo + CHUNK])
                if check_finite:
                    finite = all_finite(part) and finite  # every chunk is added
            if not finite:
                return Reduced.OVERFLOW
        self.added += 1
        return Reduced.OK

    def measure(self, norm: bool, check_finite: bool) -> LayerStats:
        """Finiteness (if asked) and, if ``norm``, squared norm: one pass either way."""
        if norm:
            n = norm2(self.grad)
            return LayerStats(math.isfinite(n), n * n)
        return LayerStats(all_finite(self.grad) if check_finite else True, 0.0)

    def step(self, t: int, grad_scale: float, cfg: OptimizerConfig) -> None:
        self.optimizer.step(t, lr=cfg.lr_at(t), grad_scale=grad_scale, cfg=cfg)

    def update(self, job: Update) -> bool:
        s = self.measure(norm=bool(job.cfg.clip_norm), check_finite=job.check_finite)
        if s.finite:
            coef = clip_coefficient(math.sqrt(s.norm_sq), job.cfg.clip_norm, job.loss_scale)
            self.step(job.t, job.loss_scale / coef, job.cfg)
        self.added = 0
        return s.finite


def layer_math(store: LayerStore, cfg: OptimizerConfig) -> list[LayerMath]:
    """Accumulators and optimizers (state created explicitly, zero) for every layer."""
    out = []
    for plan in store.layout.layers:
        grad = torch.zeros(plan.numel, dtype=torch.float32)
        compute = store.compute(plan.index) if store.compute_region is not None else None
        out.append(LayerMath(make_optimizer(plan, store.master(plan.index), grad, compute,
                                            cfg), grad))
    return out


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
        self.budget = ThreadBudget(n)
        self.inline = inline
        self._stopping = False
        self._parks: list[_Park] = []  # exclusive jobs under way (released on close)
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(self.n)]
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
                    with self.budget.share():  # the others are parked: all of them
                        done = self._execute(job)
                finally:
                    park.release.set()
            else:
                with self.budget.share():
                    done = self._execute(item)
            self.on_done(done)

    def _execute(self, job) -> Done:
        t0 = time.perf_counter()
        try:
            result = self._dispatch(job)
        except Exception as e:  # reported to the core, which decides what it means
            log.exception("engine job %s failed", type(job).__name__)
            return Done(job, error=e, seconds=time.perf_counter() - t0)
        return Done(job, result, seconds=time.perf_counter() - t0)

    def _dispatch(self, job):
        if isinstance(job, Reduce):
            with self.tracer.span(f"reduce L{job.layer} r{job.rank}", "reduce"):
                return self.layers[job.layer].reduce(job.src, job.check_finite)
        if isinstance(job, Update):
            with self.tracer.span(f"update L{job.layer}", "update"):
                self.store.retain(job.layer)
                return self.layers[job.layer].update(job)
        if isinstance(job, Measure):
            with self.tracer.span(f"measure L{job.layer}", "update"):
                return self.layers[job.layer].measure(norm=True, check_finite=True)
        if isinstance(job, Apply):
            with self.tracer.span(f"apply L{job.layer}", "update"):
                self.store.retain(job.layer)
                math_ = self.layers[job.layer]
                if job.divisor is not None:
                    math_.step(job.t, job.divisor, job.cfg)
                math_.added = 0
                return job.divisor is not None
        if isinstance(job, Init):
            if not all_finite(job.data):
                return False
            self.store.master(job.layer).copy_(job.data)
            self.store.publish(job.layer)
            return True
        if isinstance(job, Exclusive):
            with self.tracer.span(job.what, "checkpoint"):
                return job.fn()
        raise TypeError(f"unknown engine job {job!r}")
