"""When layers are updated and checkpoints written (part of the core: no I/O, no threads).

A layer whose gradients are all in for step t is *pending* (nobody may read version t any
more) and gets its Update job. How the step's layers are updated (updater.py says why):

    plain      (eager, no clipping, no loss scaling) each layer updated at once (FINAL) and
               its version t+1 published when done: the L2Lp overlap
    validated  (--clip-norm, fp16 loss scaling, or --update deferred) the step's global
               decision (clip coefficient, overflow skip) needs every layer's gradient. Each
               layer's gradient is kept and the layer either updated at once when the guess
               says the step will need no clipping (SPECULATE: eager AdamW, speculation.py)
               or left for later (HOLD: deferred, LAMB, SGD, or a guess against). Once every
               layer is in, the step is decided (``_decide``): a right guess is published as
               it is, a wrong one undone and redone (Resolve REDO, UNDO), a held one applied
               (APPLY); layer 0 first, where the next forward starts. Nothing is published
               before the decision.

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

from protocol import checkpoints as layout_on_disk

from . import checkpoint
from .boxes import BoxLost
from .config import ServerConfig
from .data_position import DataPosition
from .engines import Engines
from .jobs import (
    Action,
    Done,
    Exclusive,
    Part,
    Requester,
    Resolve,
    SaveTicket,
    Update,
    Updated,
    Verdict,
)
from .layer_store import LayerStore
from .saving import describe
from .speculation import StepCheck, StepNorms
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

    requester: Requester | None  # None: a periodic checkpoint
    path: str
    step: int
    error: str | None = None
    refused: bool = False  # the error is the OS's (a full or read-only disk), not a bug
    lost: bool = False  # shard mode: a box was lost while they wrote it (no disk's fault)


class UpdateScheduler:
    def __init__(self, cfg: ServerConfig, store: LayerStore, engines: Engines, stats: EpsStats,
                 run_id: str):
        self.cfg, self.store, self.engines, self.stats = cfg, store, engines, stats
        self.run_id = run_id
        self.versions = store.versions
        self.num_layers = store.num_layers
        self.scaler = LossScaler(cfg.loss_scale, cfg.loss_scale_window, cfg.loss_scaling)
        self.pending: set[int] = set()  # layers whose update is due or running
        self.rewriting: set[int] = set()  # layers whose weights may differ from their version
        # --recovery: layers being rewritten whose retained copy (their current version, made
        # by the first job of the step that rewrote them) is complete: readable now
        self.retained: set[int] = set()
        self.overflow_steps: set[int] = set()
        self._steps: dict[int, StepCheck | None] = {}  # t -> its check (None: plain)
        self._due: list[Publish] = []  # versions to publish now (no job to wait for)
        self._hold_from: int | None = None  # a checkpoint holds updates from this version on
        self._committed = 0  # highest version an update under way will reach
        self._held: list[tuple] = []  # (version, start, its Update or None) held back
        self._saves: deque[tuple[str, Requester | None]] = deque()  # one written at a time
        self._writing = False
        self._last_saved: dict[str, tuple] = {}  # root -> (step, settings) last written there
        self._last_step = time.perf_counter()
        self.model = cfg.model_record  # the job's model options, opaque: for l2l-export
        self.data = DataPosition()

    # -- updates -----------------------------------------------------------------------

    def validated(self) -> bool:
        """Steps need the global decision (as set now: a step keeps what it began with)."""
        return (self.cfg.update == "deferred" or self.cfg.optimizer.clip_norm > 0
                or self.cfg.loss_scaling)

    def _step(self, t: int) -> StepCheck | None:
        if t not in self._steps:
            cfg = self.cfg.optimizer
            self._steps[t] = StepCheck(t, cfg, StepNorms(self.num_layers, cfg.clip_norm)) \
                if self.validated() else None
        return self._steps[t]

    def reduced(self, layer: int, t: int, parts: tuple[Part, ...]) -> None:
        """Every rank's gradient of ``layer`` for step ``t`` is in (``parts``, rank order)."""
        self.pending.add(layer)
        check = self._step(t)
        if check is None:
            job = Update(layer, t, parts, Action.FINAL, self.scaler.scale, self.cfg.optimizer,
                         skips_overflow=self.cfg.loss_scaling)
        else:
            if check.scale is None:
                check.scale = check.norms.scale = self.scaler.scale
            # The guess may wait for the layers above only if their jobs were sent before.
            guess = (self.cfg.update == "eager" and self.engines.layers[layer].optimizer.can_undo
                     and check.sent.issuperset(range(layer + 1, self.num_layers)))
            check.sent.add(layer)
            job = Update(layer, t, parts, Action.SPECULATE if guess else Action.HOLD,
                         check.scale, check.cfg, check.norms if guess else None,
                         skips_overflow=self.cfg.loss_scaling)
        self._when_released(t, partial(self._submit, job), job)

    def _submit(self, job: Update | Resolve) -> None:
        if isinstance(job, Resolve) and job.verdict is Verdict.APPLY or \
                isinstance(job, Update) and job.action is not Action.HOLD:
            self.rewriting.add(job.layer)
        self.engines.submit(job)

    def skipped(self, layer: int, t: int) -> None:
        """Every rank skipped ``layer`` at step ``t`` (LayerDrop): its version advances with
        its optimizer state untouched, as torch's optimizers skip a parameter without grad."""
        if self.engines.boxes is not None:  # every box skips it: no collective for it
            self.engines.boxes.skip(layer, t)
        self.pending.add(layer)
        check = self._step(t)
        if check is None:
            self._when_released(t, partial(self._advance, layer, t))
        else:
            check.sent.add(layer)
            check.norms.record(layer, 0.0)
            self._collect(check, layer, LayerStats(True, 0.0))

    def updated(self, done: Done) -> None:
        """An Update finished (its replies are the data plane's)."""
        job: Update = done.job
        result: Updated = done.result
        self.stats.update_seconds += done.seconds - result.check_seconds
        self.stats.reduce_seconds += result.check_seconds
        checked = result.checked
        if not checked.finite and not self.cfg.loss_scaling:  # refused: pushed again later
            self.pending.discard(job.layer)
            self.rewriting.discard(job.layer)
            return
        if result.rewritten:
            self.retained.add(job.layer)
        else:  # held after all (the guess): nothing rewrites it before the decision
            self.rewriting.discard(job.layer)
        check = self._steps.get(job.t)
        if check is None:
            self._observe(done.seconds)
            self._advance(job.layer, job.t)
            return
        check.seconds[job.layer] = done.seconds  # observed once the decision is carried out
        if result.kept is not None:
            check.kept[job.layer] = (result.kept, result.rewritten)
        self._collect(check, job.layer, LayerStats(checked.finite, checked.norm_sq))

    def resolved(self, done: Done) -> None:
        """A Resolve finished: the layer's step is done."""
        job: Resolve = done.job
        self.retained.add(job.layer)  # an APPLY copied it; a REDO or UNDO's update had
        self.stats.update_seconds += done.seconds
        if job.verdict is not Verdict.APPLY:
            self.stats.rollback_seconds += done.seconds
        check = self._steps.get(job.t)
        self._observe(done.seconds + (check.seconds.pop(job.layer, 0.0) if check else 0.0))
        self._advance(job.layer, job.t)

    def _observe(self, seconds: float) -> None:
        """A layer's update of a step took ``seconds`` (its Update, and its Resolve if any)."""
        self.stats.update_latency.observe(seconds)

    def _advance(self, layer: int, t: int) -> None:
        """Layer ``layer`` is done with step ``t``: version t+1 is due. --recovery: a layer no
        job rewrote this step (skipped, or not updated) has its retained copy refreshed here,
        as an update's job does, so it holds version t once t+1 is published."""
        if layer not in self.retained:
            self.store.retain(layer)
        self.stats.updates += 1
        self._due.append(Publish(layer, t + 1))

    def _collect(self, check: StepCheck, layer: int, stats: LayerStats) -> None:
        check.stats[layer] = stats
        if len(check.stats) == self.num_layers:
            self._decide(check)

    def _decide(self, check: StepCheck) -> None:
        """Every layer of step ``check.t`` is in: clip, skip or let the guess stand."""
        scale = check.scale or self.scaler.scale  # (every layer skipped: nothing was sent)
        divisor = deferred_divisor(check.stats, check.cfg.clip_norm, scale)
        t = check.t
        if divisor is None:
            self.overflow_steps.add(t)
            self.stats.overflow_steps = len(self.overflow_steps)
            self.stats.skipped_updates += self.num_layers
        elif divisor != scale:
            self.stats.clipped_steps += 1
        for layer in range(self.num_layers):  # layer 0 first: the next step starts there
            kept, speculated = check.kept.pop(layer, (None, False))
            if kept is None:  # skipped by every rank, or not finite: nothing was written
                if layer in check.seconds:  # (its check ran)
                    self._observe(check.seconds.pop(layer))
                self._advance(layer, t)
            elif speculated and divisor == scale or not speculated and divisor is None:
                self.engines.layers[layer].release(kept)  # a right guess, or a skipped hold
                self._observe(check.seconds.pop(layer, 0.0))
                self._advance(layer, t)
            else:
                verdict = (Verdict.APPLY if not speculated else
                           Verdict.UNDO if divisor is None else Verdict.REDO)
                if verdict is not Verdict.APPLY:
                    self.stats.rollbacks += 1
                self._submit(Resolve(layer, t, verdict, kept, divisor or scale, scale,
                                     check.cfg))

    def due(self) -> list[Publish]:
        """The versions to publish now (taken)."""
        out, self._due = self._due, []
        return out

    def published(self, layer: int, version: int) -> None:
        self.pending.discard(layer)
        self.rewriting.discard(layer)
        self.retained.discard(layer)
        if min(self.versions) >= version:
            self._steps.pop(version - 1, None)

    def drop_held_updates(self) -> list[Update]:
        """The server stops updating: the Updates a checkpoint holds back are dropped (their
        gradients get an Error)."""
        jobs = [job for _, _, job in self._held if job is not None]
        self._held = [h for h in self._held if h[2] is None]
        return jobs

    def _when_released(self, t: int, start, job: Update | None = None) -> None:
        """Run ``start`` (work towards version t+1; ``job``: the Update it sends) now, or
        once a checkpoint's hold lifts."""
        if self._hold_from is not None and t >= self._hold_from:
            self._held.append((t, start, job))
            return
        self._committed = max(self._committed, t + 1)
        start()

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

    def request_save(self, path: str, requester: Requester | None) -> None:
        self._saves.append((path, requester))
        self._begin_save()

    def abandon_saves(self) -> list[Requester]:
        """The server broke: the boundary the Saves not yet being written wait for never
        comes. They are dropped; their requesters (to be told why) are returned."""
        writing = [self._saves.popleft()] if self._writing else []
        dropped = [who for _, who in self._saves if who is not None]
        self._saves.clear()
        self._saves.extend(writing)
        return dropped

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
        path, requester = self._saves[0]
        target = self._hold_from
        optimizers = [m.optimizer for m in self.engines.layers]
        extra = self.checkpoint_extra()
        write = partial(checkpoint.save, path, self.store, optimizers, extra,
                        self.cfg.keep_checkpoints, self.engines.boxes)
        self.engines.exclusive(Exclusive(write, f"checkpoint {target}",
                                         SaveTicket(requester, path, target, extra)))

    def saved(self, done: Done) -> Saved:
        ticket: SaveTicket = done.job.ticket
        if done.error is None:
            self._last_saved[os.path.abspath(ticket.path)] = (ticket.target,
                                                              _settings(ticket.extra))
        self._saves.popleft()
        self._writing = False
        self._hold_from = None
        held, self._held = self._held, []
        for t, start, job in held:
            self._when_released(t, start, job)
        self._begin_save()
        error = None if done.error is None else describe(done.error)
        return Saved(ticket.requester, ticket.path, ticket.target, error,
                     isinstance(done.error, OSError), isinstance(done.error, BoxLost))

    def loaded(self, directory: str, step: int, state: dict) -> None:
        """Resumed from checkpoint ``directory`` at ``step``: if it is its root's latest, a
        final checkpoint of that step with the same settings there would only repeat it (and
        prune it). (An older one loaded is written again: it becomes the latest.)"""
        self.model = self.model if self.model is not None else state.get("model")
        self.data.loaded(step, state)
        root = os.path.dirname(os.path.abspath(directory))
        try:
            if os.path.realpath(layout_on_disk.resolve(root)) != os.path.realpath(directory):
                return
        except (OSError, ValueError):
            return
        self._last_saved[root] = (step, _settings({k: state.get(k)
                                                   for k in self.checkpoint_extra()}))

    def checkpoint_extra(self) -> dict:
        extra = {"run_id": self.run_id, "optimizer": self.cfg.optimizer.as_dict(),
                 "precision": self.cfg.precision, "loss_scaler": self.scaler.state(),
                 "data": self.data.record(self.store.step), "model": self.model}
        return {k: v for k, v in extra.items() if v is not None}

    def final_checkpoint(self, path: str) -> bool | None:
        """At exit, with the engines stopped: write the last state, unless a step is half
        done (a mixed state would not be a step of training). True if written, None if there
        was nothing to write; raises OSError if the OS refused it."""
        if not self.settled() or self.rewriting:
            log.warning("exiting mid-step (layer versions %d..%d, %d updates pending): not "
                        "saving a mixed state (an earlier checkpoint, if any, stands)",
                        min(self.versions), max(self.versions), len(self.pending))
            return None
        if self._last_saved.get(os.path.abspath(path)) == (
                self.store.step, _settings(self.checkpoint_extra())):
            log.info("step %d is saved in %s already", self.store.step, path)
            return None
        boxes = self.engines.boxes
        if self.store.sharding is not None and boxes.lost:  # every box's part or none
            log.warning("not writing the final checkpoint: the boxes' group is lost (%s)",
                        boxes.lost)
            return None
        checkpoint.save(path, self.store, [m.optimizer for m in self.engines.layers],
                        self.checkpoint_extra(), self.cfg.keep_checkpoints, boxes)
        return True


def _settings(extra: dict) -> dict:
    """What makes two checkpoints of one step differ: all but the run id, which a resumed run
    may change, and the data's record (of one step of one run: the same samples, whatever the
    batch shape of the run that resumed from it)."""
    return {k: v for k, v in extra.items() if k not in ("run_id", "data")}
