"""The update and checkpoint half of the EPS (event-loop side; the math runs in ``updater``).

A layer whose reduction completed is updated eagerly (``_update``) or, in deferred mode, once
every layer of the step is in (``_collect``); either way ``_finish`` publishes its next
version. A checkpoint holds the updates that would start the next step, waits for the step
boundary, writes, and releases them. Mixed into ``EpsServer``, whose state it uses: cfg, store,
reducer, updater, board, locks, tracer, stats, and the helpers _math, _spawn and _control.
"""

from __future__ import annotations

import asyncio
import logging
import time

from protocol.messages import Ack, HyperAck, Save, SetHyper

from . import checkpoint
from .config import with_changes
from .errors import RequestError

log = logging.getLogger("eps_server")


class Stepping:
    def _publish(self, layer: int, version: int) -> None:
        if self.board.set(layer, version):
            self._on_step_complete(self.board.step)

    def _on_step_complete(self, step: int) -> None:
        """Every layer has reached version ``step``: step-1 is done (0: initial values in)."""
        now = time.perf_counter()
        if step == 0:
            log.info("model initialised")
        else:
            self.updater.step_done(step - 1)
            self.stats["steps_completed"] += 1
            log.info("step %d complete (%.3f s)", step - 1, now - self._last_step_time)
        self._last_step_time = now
        every = self.cfg.checkpoint_every
        if every and step > 0 and step % every == 0:
            self._spawn(self._save_at_boundary(self.cfg.save))

    async def _held(self, version: int) -> None:
        """Wait while a checkpoint holds updates that would start step ``version``+1; then
        record that an update to ``version``+1 is under way (a checkpoint must wait for it)."""
        while self._hold_from is not None and version >= self._hold_from:
            await self._released.wait()
        self._committed = max(self._committed, version + 1)

    async def _update(self, layer: int, version: int) -> None:
        """Eager: update ``layer`` as soon as every worker's gradient of it is in."""
        await self._held(version)
        await self._guarded(layer, version, self.updater.eager, layer, version)

    async def _collect(self, layer: int, version: int) -> None:
        """Deferred: gather the step's per-layer statistics; the last layer in runs the step."""
        stats = await self._guarded(layer, None, self.updater.deferred_stats, layer)
        if stats is None:
            return
        pending = self._deferred.setdefault(version, {})
        pending[layer] = stats
        if len(pending) < self.store.num_layers:
            return
        del self._deferred[version]
        cfg = self.cfg.optimizer  # one setting for the whole step, whatever SetHyper does
        divisor = self.updater.deferred_plan(pending, version, cfg)
        await self._held(version)
        for lay in range(self.store.num_layers):  # layer 0 first: the next step starts there
            if divisor is None:
                self._finish(lay, version)
            else:
                self._spawn(self._guarded(lay, version, self.updater.apply, lay, version,
                                          divisor, cfg))

    async def _guarded(self, layer: int, version: int | None, fn, *args):
        """Run ``fn`` on a math thread under the layer's lock; then, if ``version`` is given,
        publish the layer's next version. A failure breaks the server (see _break)."""
        try:
            async with self.locks[layer]:
                t0 = time.perf_counter()
                with self.tracer.span(f"{fn.__name__} L{layer}", "update"):
                    result = await self._math(fn, *args)
                self.stats["update_seconds"] += time.perf_counter() - t0
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("update of layer %d failed", layer)
            self._broken = f"update of layer {layer} failed: {type(e).__name__}: {e}"
            self.board.fail(None, "internal", self._broken)
            return None
        if version is not None:
            self._finish(layer, version)
        return result

    def _finish(self, layer: int, version: int) -> None:
        self.stats["updates"] += 1
        self.reducer.reset(layer)
        self.board.updating.discard(layer)
        self._publish(layer, version + 1)

    def _checkpoint_extra(self) -> dict:
        s = self.updater.scaler
        return {"run_id": self.run_id, "optimizer": self.cfg.optimizer.as_dict(),
                "precision": self.cfg.precision,
                "loss_scaler": {"scale": s.scale, "good_steps": s.good_steps}}

    async def _save_at_boundary(self, path: str) -> int:
        """Checkpoint at a step boundary: hold updates that would start the next step, wait
        until every layer has reached the same version, write, release."""
        while self._hold_from is not None:  # one checkpoint at a time
            await self._released.wait()
        # The boundary: what every layer has reached, or will once the updates already
        # under way finish (they cannot be held back any more).
        target = max(max(self.store.versions), self._committed)
        self._hold_from = target
        self._released.clear()
        try:
            await self.board.wait_for_step(target)
            t0 = time.perf_counter()
            with self.tracer.span(f"checkpoint {target}", "checkpoint"):
                await self._math(checkpoint.save, path, self.store, self.optimizers,
                                 self._checkpoint_extra())
            log.info("checkpoint of step %d written to %s (%.2f s)", target, path,
                     time.perf_counter() - t0)
            return target
        finally:
            self._hold_from = None
            self._released.set()

    async def _stop_when_settled(self, timeout: float = 60.0) -> None:
        """Stop once no update is pending or running and every layer has the same version (the
        last step's updates finish before the final checkpoint is written)."""
        def settled() -> bool:
            return not self.board.updating and min(self.store.versions) == max(
                self.store.versions)

        if self.store is not None:
            try:
                async with self.board.changed:
                    await asyncio.wait_for(self.board.changed.wait_for(settled), timeout)
            except asyncio.TimeoutError:
                log.warning("the last step's updates did not finish within %.0f s", timeout)
        await asyncio.sleep(0.05)  # let the last replies (Bye's Ack) go out
        self._stop.set()

    async def _shutdown_save(self) -> None:
        if not self.cfg.save or self.store is None or not self.store.initialised:
            return
        if self.board.updating or min(self.store.versions) != max(self.store.versions):
            log.warning("exiting mid-step (layer versions %d..%d, %d updates pending): not "
                        "saving a mixed state; the last checkpoint stands",
                        min(self.store.versions), max(self.store.versions),
                        len(self.board.updating))
            return
        await self._math(checkpoint.save, self.cfg.save, self.store, self.optimizers,
                         self._checkpoint_extra())
        log.info("final checkpoint of step %d written to %s", self.store.step, self.cfg.save)

    # -- control requests that act on updates and checkpoints --------------------------

    async def on_set_hyper(self, identity: bytes, msg: SetHyper, frames):
        self._control(identity)
        try:
            new = with_changes(self.cfg.optimizer, msg.changes)
        except (ValueError, TypeError) as e:
            raise RequestError("bad_request", str(e), "changes") from None
        self.cfg.optimizer = new
        for opt in self.optimizers:  # read once per update: applies from the next one
            opt.cfg = new
        log.info("hyperparameters changed: %s", msg.changes)
        return HyperAck(req_id=msg.req_id, optimizer=new.as_dict()), ()

    async def on_save(self, identity: bytes, msg: Save, frames):
        self._control(identity)
        try:
            checkpoint.check_target(msg.path)
        except ValueError as e:
            raise RequestError("bad_request", str(e), "path") from None
        if self.store is None or not self.store.initialised:
            raise RequestError("not_ready", "nothing to save: the model is not initialised")
        await self._save_at_boundary(msg.path)
        return Ack(req_id=msg.req_id), ()
