"""Weights out and gradients in (part of the core: no I/O, no threads): Fetches and the ones
waiting for a version, pushes and their reduction, and publishing each layer's next version.

A Fetch is answered at once when its version exists, else it waits on the version board. A
push is checked, claimed for its rank and reduced on the layer's engine; the last part makes the
layer due for its update (scheduler.py), whose completion publishes the next version.
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

    def check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.store.num_layers:
            raise RequestError("bad_request",
                               f"layer {layer} out of range [0, {self.store.num_layers})", "layer")

    # ------------------------------------------------------------------------- weights

    def fetch(self, identity: bytes, msg: Fetch, frames=()) -> list[Out]:
        self.peers.get(identity)
        self.check_layer(msg.layer)
        current = self.store.versions[msg.layer]
        if msg.min_version > current + 1:
            raise RequestError("bad_request", f"layer {msg.layer} is at version {current}; "
                               f"version {msg.min_version} is more than one step ahead",
                               "min_version")
        if msg.min_version <= current and self.parts.all_claimed(msg.layer):
            raise RequestError("bad_request", f"version {current} of layer {msg.layer} is being "
                               "replaced: every worker has pushed its gradient", "min_version")
        if self.board.ready(msg.layer, msg.min_version):
            return [self._layer_ready(identity, msg)]
        self.board.wait(Waiter(identity, msg, msg.layer, msg.min_version))
        return []

    def _layer_ready(self, identity: bytes, msg: Fetch) -> Out:
        peer, plan, store = self.peers.get(identity), self.store.plan(msg.layer), self.store
        if msg.which == "master" or store.compute_region is None:
            region, dtype = store.master_region, "float32"
        else:
            region, dtype = store.compute_region, store.compute_dtype
        name, offset, out = peer.transport.layer_out(region, plan.byte_offset(dtype),
                                                     plan.nbytes(dtype))
        self.stats.fetches += 1
        return Out(identity, LayerReady(
            req_id=msg.req_id, layer=msg.layer, version=store.versions[msg.layer], region=name,
            offset=offset, nbytes=plan.nbytes(dtype), dtype=dtype,
            loss_scale=self.scheduler.scaler.scale), out)

    def publish(self, layer: int, version: int) -> list[Out]:
        """``layer`` reached ``version``: answer who waited for it; maybe a step completed."""
        skipped = self.parts.reset(layer)
        if self.board.set(layer, version):
            self.scheduler.step_completed(self.board.step)
        outs = [self._layer_ready(w.peer, w.request) for w in self.board.answerable()]
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
        peer = self.peers.get(identity)
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
        self.stats.bytes_reduced += done.job.src.numel() * done.job.src.element_size()
        if self.parts.add(msg.layer):
            self.scheduler.reduced(msg.layer, msg.step)
        return [Out(identity, GradAck(req_id=msg.req_id, step=msg.step, layer=msg.layer,
                                      slot=msg.slot))]
