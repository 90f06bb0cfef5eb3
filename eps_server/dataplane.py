"""Weights out and gradients in (part of the core: no I/O, no threads): Fetches and the ones
waiting for a version, pushes and their reduction, and publishing each layer's next version.

A Fetch is answered at once when its version exists, else it waits on the version board. A
push is checked, claimed for its rank and reduced on the layer's engine; the last part makes the
layer due for its update (scheduler.py), whose completion publishes the next version.

Recovery (--recovery): an update first copies the version it replaces to the store's retained
copy, so version v of a layer stays readable until the layer reaches v+2. A worker replacing a
dead one resumes the step that one was in (``resume_point``): it fetches that step's versions
(retained where the layer moved on) and pushes only the layers its rank has not pushed yet.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from protocol.messages import Fetch, GradAck, LayerReady, PushGrad

from .config import ServerConfig
from .contributions import Contributions
from .engines import Done, Engines, Reduce, Reduced
from .errors import RequestError
from .layer_store import LayerStore
from .peers import Peers
from .replies import Out, error_out
from .scheduler import UpdateScheduler
from .stats import EpsStats
from .versions import VersionBoard, Waiter

log = logging.getLogger("eps_server")


class DataPlane:
    def __init__(self, cfg: ServerConfig, store: LayerStore, engines: Engines,
                 scheduler: UpdateScheduler, peers: Peers, stats: EpsStats,
                 stop_updating: Callable[[str], list[Out]]):
        self.cfg, self.store, self.engines, self.scheduler = cfg, store, engines, scheduler
        self.peers, self.stats, self.stop_updating = peers, stats, stop_updating
        self.board = VersionBoard(store, gate_on_step=cfg.loss_scaling)
        self.parts = Contributions(store.num_layers, cfg.world_size)  # this step's pushes
        self.published_at: list[float | None] = [None] * store.num_layers  # peers' clock

    def check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.store.num_layers:
            raise RequestError("bad_request",
                               f"layer {layer} out of range [0, {self.store.num_layers})", "layer")

    # ------------------------------------------------------------------------- weights

    def fetch(self, identity: bytes, msg: Fetch, frames=()) -> list[Out]:
        peer = self.peers.worker(identity)
        self.check_layer(msg.layer)
        layer, want = msg.layer, msg.min_version
        current = self.store.versions[layer]
        if want > current + 1:
            raise RequestError("bad_request", f"layer {layer} is at version {current}; "
                               f"version {want} is more than one step ahead", "min_version")
        replaced = want == current and self.parts.all_claimed(layer)  # its update is due
        if self._retaining(msg):
            replaced = replaced or (want == current and self.parts.has(layer, peer.rank))
            if want < current - 1:
                raise RequestError("bad_request", f"version {want} of layer {layer} is gone "
                                   f"(the layer is at version {current})", "min_version")
            if (want == current and self.parts.has(layer, peer.rank)
                    and layer not in self.scheduler.updating):
                # A replacement redoing its step reads a layer its rank pushed: the update may
                # be sent any time, so it reads a copy, made now while no job rewrites the
                # layer (the retained version, current-1, is nobody's any more). Once the
                # update is sent, it waits for it and reads the version it replaced.
                self.store.retain(layer)
                return [self._layer_ready(identity, msg, retained=True)]
        elif want <= current and self.parts.all_claimed(layer):
            raise RequestError("bad_request", f"version {current} of layer {layer} is being "
                               "replaced: every worker has pushed its gradient", "min_version")
        if self.board.ready(layer, want) and not replaced:
            return [self._layer_ready(identity, msg)]
        # Replaced: once the update is done, from the retained copy (never while it rewrites).
        self.board.wait(Waiter(identity, msg, layer, want, retained=replaced))
        return []

    def _retaining(self, msg: Fetch) -> bool:
        """Recovery keeps the previous served version (not the master's)."""
        return self.store.retained_region is not None and msg.which == "compute"

    def _layer_ready(self, identity: bytes, msg: Fetch, retained: bool = False) -> Out:
        peer, plan, store = self.peers.get(identity), self.store.plan(msg.layer), self.store
        version = store.versions[msg.layer]
        if self._retaining(msg) and (retained or msg.min_version == version - 1):
            region, dtype, version = store.retained_region, store.compute_dtype, msg.min_version
        elif msg.which == "master" or store.compute_region is None:
            region, dtype = store.master_region, "float32"
        else:
            region, dtype = store.compute_region, store.compute_dtype
        name, offset, out = peer.transport.layer_out(region, plan.byte_offset(dtype),
                                                     plan.nbytes(dtype))
        self.stats.fetches += 1
        if out:
            self.stats.bytes_served_frames += plan.nbytes(dtype)
        else:
            self.stats.bytes_served_shm += plan.nbytes(dtype)
        return Out(identity, LayerReady(
            req_id=msg.req_id, layer=msg.layer, version=version, region=name,
            offset=offset, nbytes=plan.nbytes(dtype), dtype=dtype,
            loss_scale=self.scheduler.scaler.scale), out)

    def resume_point(self, rank: int) -> tuple[int, tuple[int, ...]]:
        """(the step ``rank`` runs next, the layers whose part of it the EPS already has): the
        first step in which the rank has not contributed every layer. Layers are at most one
        version apart, and a layer ahead was pushed by every rank."""
        versions = self.store.versions
        step = min(versions)
        if step < 0:
            return 0, ()

        def contributed(s: int) -> set[int]:
            return {lay for lay, v in enumerate(versions) if v > s or (
                v == s and self.parts.has(lay, rank)) or (
                v == s - 1 and self.parts.skips_early(lay, rank))}

        pushed = contributed(step)
        if len(pushed) == len(versions):
            step += 1
            pushed = contributed(step)
        return step, tuple(sorted(pushed))

    def publish(self, layer: int, version: int) -> list[Out]:
        """``layer`` reached ``version``: answer who waited for it; maybe a step completed."""
        skipped = self.parts.reset(layer)
        self.published_at[layer] = self.peers.clock()
        if self.board.set(layer, version):
            self.scheduler.step_completed(self.board.step)
        outs = [self._layer_ready(w.peer, w.request, w.retained)
                for w in self.board.answerable()]
        if skipped:
            self.scheduler.skipped(layer, version)
        self.scheduler.boundary()
        return outs

    def fail_waiters(self, identity: bytes | None, code: str, why: str) -> list[Out]:
        """Answer the waiting Fetches of ``identity`` (of everyone if None) with an Error."""
        return [error_out(w.peer, w.request.req_id, code, why)
                for w in self.board.drop(identity)]

    # ------------------------------------------------------------------------- gradients

    def push(self, identity: bytes, msg: PushGrad, frames) -> list[Out]:
        peer = self.peers.worker(identity)
        self.check_layer(msg.layer)
        if msg.rank != peer.rank:
            raise RequestError("bad_request", f"this peer is rank {peer.rank}, not {msg.rank}",
                               "rank")
        version = self.store.versions[msg.layer]
        if msg.step != version and not (msg.skip and msg.step == version + 1):
            raise RequestError("bad_request", f"gradient for step {msg.step}, but layer "
                               f"{msg.layer} is at version {version}", "step")
        if msg.dtype != peer.grad_dtype:
            raise RequestError("bad_request", f"this peer said Hello with grad_dtype "
                               f"{peer.grad_dtype}, not {msg.dtype}", "dtype")
        if msg.skip:
            return self._skip(identity, msg, frames)
        src = peer.transport.gradient_in(msg, frames, self.store.plan(msg.layer))
        self.parts.claim(msg.layer, peer.rank)
        self.stats.reducing += 1
        # fp16: an overflow is expected now and then and the loss scaler deals with it.
        self.engines.submit(Reduce(msg.layer, peer.rank, src, not self.cfg.loss_scaling,
                                   (identity, msg, bool(frames))))
        return []

    def _skip(self, identity: bytes, msg: PushGrad, frames) -> list[Out]:
        """LayerDrop: no gradient; once every rank skipped the layer, its version advances
        without an update. All ranks skip the same layers, or the step is refused. A skip may
        name the step after the layer's current version (contributions.py)."""
        if frames:
            raise RequestError("bad_request", "a skip carries no gradient", "frames")
        ack = [Out(identity, GradAck(req_id=msg.req_id, step=msg.step, layer=msg.layer,
                                     slot=-1))]
        if msg.step > self.store.versions[msg.layer]:  # the layer is not there yet: it waits
            self.parts.skip_early(msg.layer, msg.rank)  # (after this rank's part of the step)
            return ack
        self.parts.claim(msg.layer, msg.rank, skip=True)
        if self.parts.add(msg.layer):
            self.scheduler.skipped(msg.layer, msg.step)
        return ack

    def reduced(self, done: Done) -> list[Out]:
        identity, msg, framed = done.job.ticket
        self.stats.reduce_seconds += done.seconds
        self.stats.reducing -= 1
        field = "frames" if framed else "slot"
        if done.result is Reduced.OVERFLOW:  # the step cannot complete: stop updating
            why = (f"the sum of layer {msg.layer}'s gradients at step {msg.step} is not finite "
                   "(finite gradients overflowed together); the layer is left as it was")
            return [error_out(identity, msg.req_id, "bad_request", why, field),
                    *self.stop_updating(why)]
        if done.error is not None or done.result is not Reduced.OK:
            self.parts.release(msg.layer, msg.rank)  # nothing was added: may push again
            if done.error is not None:
                return [error_out(identity, msg.req_id, "internal",
                                  f"{type(done.error).__name__}: {done.error}")]
            return [error_out(identity, msg.req_id, "bad_request", f"non-finite gradient for "
                              f"layer {msg.layer} from rank {msg.rank} at step {msg.step}; not "
                              "applied", field)]
        self.stats.pushes += 1
        nbytes = done.job.src.numel() * done.job.src.element_size()
        self.stats.bytes_reduced += nbytes
        if framed:
            self.stats.bytes_received_frames += nbytes
        else:
            self.stats.bytes_received_shm += nbytes
        if self.parts.add(msg.layer):
            self.scheduler.reduced(msg.layer, msg.step)
        return [Out(identity, GradAck(req_id=msg.req_id, step=msg.step, layer=msg.layer,
                                      slot=msg.slot))]
