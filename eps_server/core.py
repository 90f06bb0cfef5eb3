"""EpsCore: the Eager Param-Server's logic, synchronous and socket-free.

The shell (server.py) calls ``handle(peer, msg, frames)`` with a decoded request and sends
the replies due now (``Out``s). Work that takes time runs on the engines; ``poll()`` takes in
their results and returns the replies they made due (a GradAck after a reduction, a waiting
Fetch's LayerReady once an update published its version, a Save's Ack). Tests drive the core
in-process the same way, with inline engines. A gradient: handle(PushGrad) -> engines: Reduce
-> poll: GradAck; the last part -> scheduler -> engines: Update -> poll: Publish(l, t+1).
The model exists from construction (lobby.py makes the core). A bad request gets an Error
and changes nothing.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable

from protocol.messages import (
    PROTOCOL_VERSION,
    Ack,
    ArenaReady,
    Bye,
    Fetch,
    GradAck,
    Hello,
    HyperAck,
    InitLayer,
    LayerReady,
    Message,
    PushGrad,
    RegionInfo,
    Save,
    SetHyper,
    StashArena,
    Status,
    StatusReply,
    Welcome,
)
from protocol.trace import NULL, Tracer

from . import checkpoint
from .config import ServerConfig, with_changes
from .contributions import Contributions
from .engines import Done, Engines, Exclusive, Init, Reduce, layer_math
from .errors import RequestError
from .layer_store import LayerStore
from .peers import Peer, Peers, check_control, check_hello, check_model
from .replies import Out, error_out
from .scheduler import Publish, Saved, UpdateScheduler
from .stats import EpsStats, peak_memory_bytes
from .transports import frame_tensor, make_transport
from .versions import VersionBoard, Waiter

log = logging.getLogger("eps_server")


class EpsCore:
    def __init__(self, cfg: ServerConfig, store: LayerStore, *, run_id: str,
                 initialiser: int | None = None, stats: EpsStats | None = None,
                 wake: Callable[[], None] = lambda: None, inline: bool = False,
                 tracer: Tracer = NULL):
        self.cfg, self.store, self.run_id = cfg, store, run_id
        self.stats = stats or EpsStats()
        self.board = VersionBoard(store, gate_on_step=cfg.loss_scaling)
        self._done: queue.SimpleQueue[Done] = queue.SimpleQueue()
        self._wake = wake
        self.engines = Engines(store, layer_math(store, cfg.optimizer), cfg.threads,
                               self._on_done, inline=inline, tracer=tracer)
        self.scheduler = UpdateScheduler(cfg, store, self.engines, self.stats, run_id)
        self.peers = Peers(cfg.world_size)
        self.initialiser = initialiser  # the rank that sends the initial values
        self.parts = Contributions(store.num_layers, cfg.world_size)  # this step's pushes
        self.initialising: set[int] = set()
        self.broken: str | None = None
        self._handlers = {Hello: self._hello, InitLayer: self._init, Fetch: self._fetch,
                          PushGrad: self._push, Bye: self._bye, StashArena: self._stash_arena,
                          Status: self._status, SetHyper: self._set_hyper, Save: self._save}

    # ------------------------------------------------------------------------- entry points

    def handle(self, peer: bytes, msg: Message, frames: list) -> list[Out]:
        """Handle one decoded request; the replies due now."""
        handler = self._handlers.get(type(msg))
        try:
            if handler is None:
                raise RequestError("bad_message", f"{type(msg).__name__} is not a request",
                                   "kind")
            if self.broken is not None and type(msg) not in (Status, Bye):
                raise RequestError("internal", f"server stopped updating: {self.broken}")
            return handler(peer, msg, frames)
        except RequestError as e:
            return [error_out(peer, msg.req_id, e.code, str(e), e.field)]
        except Exception as e:  # a bug: report it, keep serving
            log.exception("internal error handling %s", type(msg).__name__)
            return [error_out(peer, msg.req_id, "internal", f"{type(e).__name__}: {e}")]

    def poll(self) -> list[Out]:
        """Take in the engines' finished jobs; the replies they made due."""
        outs: list[Out] = []
        while True:
            try:
                done = self._done.get_nowait()
            except queue.Empty:
                return outs
            try:
                outs += self._complete(done)
            except Exception as e:  # a bug in the bookkeeping: stop updating, keep answering
                log.exception("internal error completing %s", type(done.job).__name__)
                outs += self._break(f"{type(e).__name__}: {e}")

    @property
    def all_done(self) -> bool:
        """Every rank said Bye(done=True)."""
        return self.peers.all_done

    def settled(self) -> bool:
        return self.scheduler.settled()

    def idle(self) -> bool:
        """Settled, and no checkpoint waiting or being written."""
        return self.scheduler.settled() and not self.scheduler.saving

    def close(self, final_save: bool = True) -> None:
        """Stop the engines (a running job finishes), write the final checkpoint (--server-save)
        unless a step is half done, release shared memory."""
        self.engines.close()
        try:
            if final_save and self.cfg.save and self.store.initialised:
                self.scheduler.final_checkpoint(self.cfg.save)
        finally:
            self.store.close()

    # ------------------------------------------------------------------------- helpers

    def _on_done(self, done: Done) -> None:  # an engine thread (or inline: the caller)
        self._done.put(done)
        self._wake()

    def _layer(self, layer: int) -> None:
        if not 0 <= layer < self.store.num_layers:
            raise RequestError("bad_request",
                               f"layer {layer} out of range [0, {self.store.num_layers})", "layer")

    def _break(self, why: str) -> list[Out]:
        """An update failed: stop updating; every waiting Fetch gets an internal Error."""
        log.error("server stopped updating: %s", why)
        self.broken = why
        return [error_out(w.peer, w.request.req_id, "internal", why) for w in self.board.drop()]

    # ------------------------------------------------------------------------- handshake

    def _hello(self, identity: bytes, msg: Hello, frames) -> list[Out]:
        grad_dtype = check_hello(self.cfg, msg)
        check_model(self.store, msg)
        init_layers = ()
        if msg.rank == self.initialiser:  # a restarted initialiser finishes the job
            init_layers = tuple(i for i, v in enumerate(self.store.versions)
                                if v < 0 and i not in self.initialising)
        # Before any registration: a failure here changes nothing.
        transport = make_transport(msg.transport, self.store, msg.rank, grad_dtype,
                                   self.cfg.grad_slots)
        outs = []
        for old in self.peers.register(Peer(identity, msg.rank, transport, grad_dtype, msg.pid)):
            outs += self._fail_waiters(old, f"rank {msg.rank} was replaced")
        log.info("hello from rank %d (pid %d, %s, %s)", msg.rank, msg.pid, msg.host,
                 msg.transport)
        return outs + [Out(identity, Welcome(
            req_id=msg.req_id, protocol_version=PROTOCOL_VERSION, run_id=self.run_id,
            step=max(self.store.step, 0), init_layers=init_layers,
            compute_dtype=self.cfg.compute_dtype, grad_dtype=grad_dtype,
            master=self.store.master_info(), compute=self.store.compute_info(),
            grad_slots=self.cfg.grad_slots, grad_slot_numel=self.store.layout.max_layer_numel,
            world_size=self.cfg.world_size, optimizer=self.cfg.optimizer.as_dict(),
            **transport.welcome()))]

    def _init(self, identity: bytes, msg: InitLayer, frames) -> list[Out]:
        peer = self.peers.get(identity)
        self._layer(msg.layer)
        if peer.rank != self.initialiser:
            raise RequestError("bad_request", f"rank {peer.rank} is not the initialising worker "
                               f"(rank {self.initialiser})", "layer")
        data = frame_tensor(frames[0], "float32", self.store.plan(msg.layer).numel)
        if self.store.versions[msg.layer] >= 0 or msg.layer in self.initialising:
            raise RequestError("bad_request", f"layer {msg.layer} is already initialised",
                               "layer")
        self.initialising.add(msg.layer)
        self.engines.submit(Init(msg.layer, data, (identity, msg)))
        return []

    def _initialised(self, done: Done) -> list[Out]:
        identity, msg = done.job.ticket
        self.initialising.discard(msg.layer)
        if done.error is not None:
            return [error_out(identity, msg.req_id, "internal",
                              f"{type(done.error).__name__}: {done.error}")]
        if not done.result:
            return [error_out(identity, msg.req_id, "bad_request", f"initial values of layer "
                              f"{msg.layer} are not all finite", "frames")]
        return [Out(identity, Ack(req_id=msg.req_id)), *self._publish(msg.layer, 0)]

    # ------------------------------------------------------------------------- weights

    def _fetch(self, identity: bytes, msg: Fetch, frames) -> list[Out]:
        self.peers.get(identity)
        self._layer(msg.layer)
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

    def _publish(self, layer: int, version: int) -> list[Out]:
        """``layer`` reached ``version``: answer who waited for it; maybe a step completed."""
        skipped = self.parts.reset(layer)
        if self.board.set(layer, version):
            self.scheduler.step_completed(self.board.step)
        outs = [self._layer_ready(w.peer, w.request) for w in self.board.answerable()]
        if skipped:
            self.scheduler.skipped(layer, version)
        self.scheduler.boundary()
        return outs

    # ------------------------------------------------------------------------- gradients

    def _push(self, identity: bytes, msg: PushGrad, frames) -> list[Out]:
        peer = self.peers.get(identity)
        self._layer(msg.layer)
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

    def _reduced(self, done: Done) -> list[Out]:
        identity, msg, framed = done.job.ticket
        self.stats.reduce_seconds += done.seconds
        if done.error is not None or not done.result:
            self.parts.release(msg.layer, msg.rank)  # nothing was added: may push again
            if done.error is not None:
                return [error_out(identity, msg.req_id, "internal",
                                  f"{type(done.error).__name__}: {done.error}")]
            return [error_out(identity, msg.req_id, "bad_request", f"non-finite gradient for "
                              f"layer {msg.layer} from rank {msg.rank} at step {msg.step}; not "
                              "applied", "frames" if framed else "slot")]
        self.stats.pushes += 1
        self.stats.bytes_reduced += done.job.src.numel() * done.job.src.element_size()
        if self.parts.add(msg.layer):
            self.scheduler.reduced(msg.layer, msg.step)
        return [Out(identity, GradAck(req_id=msg.req_id, step=msg.step, layer=msg.layer,
                                      slot=msg.slot))]

    def _complete(self, done: Done) -> list[Out]:
        job = done.job
        if isinstance(job, Reduce):
            return self._reduced(done)
        if isinstance(job, Init):
            return self._initialised(done)
        if done.error is not None and not isinstance(job, Exclusive):
            return self._break(f"update of layer {job.layer} failed: "
                               f"{type(done.error).__name__}: {done.error}")
        outs: list[Out] = []
        for action in self.scheduler.job_done(done):
            if isinstance(action, Publish):
                outs += self._publish(action.layer, action.version)
            elif isinstance(action, Saved):
                outs += self._saved(action)
        return outs

    # ------------------------------------------------------------------------- control

    def _save(self, identity: bytes, msg: Save, frames) -> list[Out]:
        check_control(self.cfg, identity in self.peers)
        try:
            checkpoint.check_target(msg.path)
        except ValueError as e:
            raise RequestError("bad_request", str(e), "path") from None
        if not self.store.initialised:
            raise RequestError("not_ready", "nothing to save: the model is not initialised")
        self.scheduler.request_save(msg.path, (identity, msg))
        return []

    def _saved(self, saved: Saved) -> list[Out]:
        if saved.error is not None:
            log.error("checkpoint to %s failed: %s", saved.path, saved.error)
        else:
            log.info("checkpoint of step %d written to %s", saved.step, saved.path)
        if saved.ticket is None:
            return []
        identity, msg = saved.ticket
        if saved.error is not None:
            return [error_out(identity, msg.req_id, "internal",
                              f"checkpoint failed: {saved.error}")]
        return [Out(identity, Ack(req_id=msg.req_id))]

    def _set_hyper(self, identity: bytes, msg: SetHyper, frames) -> list[Out]:
        check_control(self.cfg, identity in self.peers)
        try:
            self.cfg.optimizer = with_changes(self.cfg.optimizer, msg.changes)
        except (ValueError, TypeError) as e:
            raise RequestError("bad_request", str(e), "changes") from None
        log.info("hyperparameters changed: %s", msg.changes)  # used from the next update
        return [Out(identity, HyperAck(req_id=msg.req_id, optimizer=self.cfg.optimizer.as_dict()))]

    def _stash_arena(self, identity: bytes, msg: StashArena, frames) -> list[Out]:
        peer = self.peers.get(identity)
        try:
            region = self.store.stash_region(peer.rank, msg.nbytes)
        except OSError as e:
            raise RequestError("bad_request", f"cannot allocate a stash arena of {msg.nbytes} "
                               f"bytes: {e}", "nbytes") from None
        log.info("stash arena of %.1f MiB for rank %d", msg.nbytes / 2**20, peer.rank)
        return [Out(identity, ArenaReady(req_id=msg.req_id, region=RegionInfo(
            name=region.name, nbytes=region.nbytes, dtype="uint8")))]

    def status_stats(self) -> dict:
        stats = {**self.stats.snapshot(), **peak_memory_bytes(), "lr": self.cfg.optimizer.lr,
                 "lr_now": self.cfg.optimizer.lr_at(max(self.store.step, 0)),
                 "params": self.store.manifest.num_params,
                 "loss_scale": self.scheduler.scaler.scale}
        if self.broken:
            stats["broken"] = self.broken
        return stats

    def _status(self, identity: bytes, msg: Status, frames) -> list[Out]:
        return [Out(identity, StatusReply(
            req_id=msg.req_id, run_id=self.run_id, step=max(self.store.step, 0),
            versions=tuple(self.store.versions), world_size=self.cfg.world_size,
            ranks=self.peers.ranks(),
            stats=self.status_stats()))]

    def _bye(self, identity: bytes, msg: Bye, frames) -> list[Out]:
        peer = self.peers.get(identity)
        if msg.rank != peer.rank:
            raise RequestError("bad_request", f"this peer is rank {peer.rank}, not {msg.rank}",
                               "rank")
        self.peers.leave(identity, msg.done)
        outs = self._fail_waiters(identity, f"rank {peer.rank} said Bye")
        return outs + [Out(identity, Ack(req_id=msg.req_id))]

    def _fail_waiters(self, identity: bytes, why: str) -> list[Out]:
        return [error_out(w.peer, w.request.req_id, "bad_request", why)
                for w in self.board.drop(identity)]
