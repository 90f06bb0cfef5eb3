"""When layers are updated and checkpoints written (part of the core: no I/O, no threads).

A layer whose gradients are all reduced for step t is *pending* (nobody may read version t any
more) and gets its update job, eager or deferred (updater.py says which does what):

    eager     Update(l, t) at once
    deferred  Measure(l) at once; when every layer's statistics are in, the whole step is
              decided (global clipping, or a skip on any overflow) and Apply(l, t) is sent for
              l = 0, 1, ... (the next step starts at layer 0)

An update's completion publishes version t+1 of its layer (``Publish``), which the core
records. A checkpoint holds the updates that would start the step after its *target* (the
highest version any layer has or will reach from updates already under way), waits until every
layer is at the target, writes while the engines are parked, and releases them (``Saved``).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Any

from protocol import checkpoints as layout_on_disk

from . import checkpoint
from .config import ServerConfig
from .engines import Apply, Done, Engines, Exclusive, Measure, Update
from .layer_store import LayerStore
from .stats import EpsStats
from .updater import LayerStats, LossScaler, deferred_divisor

log = logging.getLogger("eps_server")


@dataclass(frozen=True)
class Publish:
    """Layer ``layer`` has reached ``version``."""

    layer: int
    version: int


@dataclass(frozen=True)
class Saved:
    """A checkpoint of step ``step`` was written to ``path`` (or failed: ``error``)."""

    ticket: Any  # the requester (peer, Save) or None for a periodic checkpoint
    path: str
    step: int
    error: str | None = None


class UpdateScheduler:
    def __init__(self, cfg: ServerConfig, store: LayerStore, engines: Engines, stats: EpsStats,
                 run_id: str):
        self.cfg, self.store, self.engines, self.stats = cfg, store, engines, stats
        self.run_id = run_id
        self.versions = store.versions
        self.num_layers = store.num_layers
        self.scaler = LossScaler(cfg.loss_scale, cfg.loss_scale_window, cfg.loss_scaling)
        self.pending: set[int] = set()  # layers whose update is due or running
        self.updating: set[int] = set()  # layers whose Update/Apply job is sent, not done
        self.overflow_steps: set[int] = set()
        self._measured: dict[int, dict[int, LayerStats]] = {}  # deferred: t -> layer -> stats
        self._skipped: dict[int, set[int]] = {}  # deferred: t -> layers every worker skipped
        self._hold_from: int | None = None  # a checkpoint holds updates from this version on
        self._committed = 0  # highest version an update under way will reach
        self._held: list[tuple[int, Any]] = []  # (version, start) waiting for the hold to lift
        self._saves: deque[tuple[str, Any]] = deque()  # (path, ticket), one written at a time
        self._writing = False
        self._last_saved: dict[str, tuple] = {}  # root -> (step, settings) last written there
        self._last_step = time.perf_counter()

    # -- updates -----------------------------------------------------------------------

    def reduced(self, layer: int, t: int) -> None:
        """Every worker's gradient of ``layer`` for step ``t`` is in."""
        self.pending.add(layer)
        if self.cfg.update == "deferred":
            self.engines.submit(Measure(layer, t))  # reads the gradient only: never held
        else:
            self._when_released(t, partial(self._eager, layer, t))

    def skipped(self, layer: int, t: int) -> None:
        """Every worker skipped ``layer`` at step ``t`` (LayerDrop): its version advances with
        its optimizer state untouched, as torch's optimizers skip a parameter without grad."""
        self.pending.add(layer)
        if self.cfg.update == "deferred":
            self._skipped.setdefault(t, set()).add(layer)
            self._collect(layer, t, LayerStats(True, 0.0))
        else:
            self._when_released(t, partial(self._rewrite,
                                           Apply(layer, t, None, self.cfg.optimizer)))

    def _eager(self, layer: int, t: int) -> None:
        self._rewrite(Update(layer, t, self.scaler.scale, self.cfg.loss_scaling,
                             self.cfg.optimizer))

    def _rewrite(self, job: Update | Apply) -> None:
        """Send a job that rewrites the layer's weights (from now on they may change)."""
        self.updating.add(job.layer)
        self.engines.submit(job)

    def _when_released(self, t: int, start) -> None:
        """Run ``start`` (an update to t+1) now, or once a checkpoint's hold lifts."""
        if self._hold_from is not None and t >= self._hold_from:
            self._held.append((t, start))
            return
        self._committed = max(self._committed, t + 1)
        start()

    def job_done(self, done: Done) -> list:
        """An Update, Measure, Apply or checkpoint finished; returns Publish/Saved actions."""
        job = done.job
        if isinstance(job, Exclusive):
            return self._saved(done)
        self.stats.update_seconds += done.seconds
        if isinstance(job, Measure):
            return self._collect(job.layer, job.t, done.result)
        if isinstance(job, Update) and not done.result:  # an overflow: the update was skipped
            self.overflow_steps.add(job.t)
            self.stats.overflow_steps = len(self.overflow_steps)
            self.stats.skipped_updates += 1
        self.stats.updates += 1
        self.stats.update_latency.observe(done.seconds)
        self.pending.discard(job.layer)
        self.updating.discard(job.layer)
        return [Publish(job.layer, job.t + 1)]

    def _collect(self, layer: int, t: int, stats: LayerStats) -> list:
        measured = self._measured.setdefault(t, {})
        measured[layer] = stats
        if len(measured) < self.num_layers:
            return []
        del self._measured[t]
        cfg = self.cfg.optimizer  # one setting for the whole step, whatever SetHyper does
        divisor = deferred_divisor(measured, cfg.clip_norm, self.scaler.scale)
        if divisor is None:
            self.overflow_steps.add(t)
            self.stats.overflow_steps = len(self.overflow_steps)
            self.stats.skipped_updates += self.num_layers

        skipped = self._skipped.pop(t, set())

        def start() -> None:  # layer 0 first: the next step starts there
            for lay in range(self.num_layers):
                self._rewrite(Apply(lay, t, None if lay in skipped else divisor, cfg))

        self._when_released(t, start)
        return []

    def step_completed(self, step: int) -> None:
        """Every layer has reached version ``step``: step-1 is done (0: initial values in)."""
        now = time.perf_counter()
        if step == 0:
            log.info("model initialised")
            self._last_step = now
            return
        log.info("step %d complete (%.3f s)", step - 1, now - self._last_step)
        self._last_step = now
        self.scaler.step_done(step - 1 in self.overflow_steps)
        self.stats.steps_completed += 1
        every = self.cfg.checkpoint_every
        if every and step % every == 0:
            self.request_save(self.cfg.save, None)

    def settled(self) -> bool:
        """No update pending or running and every layer at the same version."""
        return not self.pending and min(self.versions) == max(self.versions)

    @property
    def saving(self) -> bool:
        """A checkpoint is waiting for its boundary or being written."""
        return bool(self._saves)

    # -- checkpoints -------------------------------------------------------------------

    def request_save(self, path: str, ticket) -> None:
        self._saves.append((path, ticket))
        self._begin_save()

    def _begin_save(self) -> None:
        if self._hold_from is not None or not self._saves:
            return
        self._hold_from = max(max(self.versions), self._committed)
        self.boundary()

    def boundary(self) -> None:
        """Write the checkpoint under way once every layer is at its target."""
        if self._hold_from is None or self._writing or min(self.versions) != self._hold_from:
            return
        self._writing = True
        path, ticket = self._saves[0]
        target = self._hold_from
        optimizers = [m.optimizer for m in self.engines.layers]
        extra = self.checkpoint_extra()
        write = partial(checkpoint.save, path, self.store, optimizers, extra,
                        self.cfg.keep_checkpoints)
        self.engines.exclusive(Exclusive(write, f"checkpoint {target}",
                                         (ticket, path, target, extra)))

    def _saved(self, done: Done) -> list:
        ticket, path, target, extra = done.job.ticket
        if done.error is None:
            self._last_saved[os.path.abspath(path)] = (target, _settings(extra))
        self._saves.popleft()
        self._writing = False
        self._hold_from = None
        held, self._held = self._held, []
        for t, start in held:
            self._when_released(t, start)
        self._begin_save()
        error = None if done.error is None else f"{type(done.error).__name__}: {done.error}"
        return [Saved(ticket, path, target, error)]

    def loaded(self, directory: str, step: int, state: dict) -> None:
        """Resumed from checkpoint ``directory`` at ``step``: if it is its root's latest, a
        final checkpoint of that step with the same settings there would only repeat it (and
        prune it). (An older one loaded is written again: it becomes the latest.)"""
        root = os.path.dirname(os.path.abspath(directory))
        try:
            if os.path.realpath(layout_on_disk.resolve(root)) != os.path.realpath(directory):
                return
        except (OSError, ValueError):
            return
        self._last_saved[root] = (step, _settings({k: state.get(k)
                                                   for k in self.checkpoint_extra()}))

    def checkpoint_extra(self) -> dict:
        return {"run_id": self.run_id, "optimizer": self.cfg.optimizer.as_dict(),
                "precision": self.cfg.precision, "loss_scaler": self.scaler.state()}

    def final_checkpoint(self, path: str) -> None:
        """At exit, with the engines stopped: write the last state, unless a step is half
        done (a mixed state would not be a step of training)."""
        if not self.settled():
            log.warning("exiting mid-step (layer versions %d..%d, %d updates pending): not "
                        "saving a mixed state; the last checkpoint stands", min(self.versions),
                        max(self.versions), len(self.pending))
            return
        if self._last_saved.get(os.path.abspath(path)) == (
                self.store.step, _settings(self.checkpoint_extra())):
            log.info("step %d is saved in %s already", self.store.step, path)
            return
        checkpoint.save(path, self.store, [m.optimizer for m in self.engines.layers],
                        self.checkpoint_extra(), self.cfg.keep_checkpoints)
        log.info("final checkpoint of step %d written to %s", self.store.step, path)


def _settings(extra: dict) -> dict:
    """What makes two checkpoints of one step differ: all but the run id, which a resumed run
    may change."""
    return {k: v for k, v in extra.items() if k != "run_id"}
