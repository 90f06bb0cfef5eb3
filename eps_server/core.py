"""EpsCore: the Eager Param-Server's logic, synchronous and socket-free.

The shell (server.py) calls ``handle(peer, msg, frames)`` with a decoded request and sends
the replies due now (``Out``s). Work that takes time runs on the engines; ``poll()`` takes in
their results and returns the replies they made due (GradAcks once an update has read the
gradients, a waiting Fetch's LayerReady once an update published its version, a Save's Ack).
Tests drive the core in-process the same way, with inline engines. A gradient:
handle(PushGrad) -> data plane: held; the last rank's part -> scheduler -> engines: Update ->
poll: GradAcks and Publish(l, t+1) (or, for a step being decided, Resolve -> Publish).
The model exists from construction (lobby.py makes the core). A bad request gets an Error
and changes nothing. Every request marks its peer alive; ``expire()``, called periodically,
declares peers silent for the heartbeat timeout dead (peers.py) and frees their ranks.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable

from protocol.messages import (
    ANY_RANK,
    PROTOCOL_VERSION,
    Ack,
    Bye,
    Fetch,
    Heartbeat,
    Hello,
    InitLayer,
    Message,
    PushGrad,
    Save,
    SetHyper,
    StashArena,
    Status,
    Welcome,
)
from protocol.trace import NULL, Tracer

from .boxes import CrossBox
from .buffers import BufferPool
from .config import ServerConfig
from .control import ControlRequests
from .dataplane import DataPlane
from .engines import Engines, layer_maths
from .errors import RequestError
from .jobs import Done, Exclusive, Init, Requester, Resolve, Update
from .layer_store import LayerStore
from .peers import Peer, Peers, check_hello, check_model
from .pool import MathPool
from .replies import Duplicate, Out, Waiting, error_out
from .saving import SaveOutcomes
from .scheduler import UpdateScheduler
from .stats import EpsStats, peak_memory_bytes
from .transports import initial_values, make_transport

log = logging.getLogger("eps_server")


class EpsCore(ControlRequests):
    def __init__(self, cfg: ServerConfig, store: LayerStore, *, run_id: str,
                 initialiser: int | None = None, stats: EpsStats | None = None,
                 wake: Callable[[], None] = lambda: None, inline: bool = False,
                 tracer: Tracer = NULL, clock: Callable[[], float] = time.monotonic,
                 notify: Callable[[object], None] = lambda event: None):
        self.cfg, self.store, self.run_id = cfg, store, run_id
        self.stats = stats or EpsStats()
        self.saves = SaveOutcomes(self.stats, notify)  # events for the EPS's starter
        self._rss_before = peak_memory_bytes().get("vmrss_bytes", 0)  # before the model's memory
        self._done: queue.SimpleQueue[Done] = queue.SimpleQueue()
        self._wake = wake
        self.pool = MathPool(cfg.math_threads, inline=inline)
        self.buffers = BufferPool()
        self.engines = Engines(store, layer_maths(store, cfg.optimizer, self.pool, self.buffers),
                               CrossBox.engines(cfg), self._on_done, inline=inline, tracer=tracer)
        if cfg.boxes.nodes > 1:  # the group was joined at the server's start (server.py)
            self.engines.boxes = CrossBox.of(cfg.boxes, store, self.engines.n)
        self.scheduler = UpdateScheduler(cfg, store, self.engines, self.stats, run_id)
        self.peers = Peers(cfg.world_size, cfg.heartbeat_timeout, clock)
        self._lost: list[Peer] = []  # declared dead, not yet reported by expire()
        self._orphans: list[Out] = []  # replies due since a peer was declared dead (poll)
        self.waiting = Waiting(cfg.peer_requests)
        self.initialiser = initialiser  # the rank that sends the initial values
        self.data = DataPlane(cfg, store, self.engines, self.scheduler, self.peers, self.stats,
                              self._break)
        self.initialising: set[int] = set()
        self.broken: str | None = None
        self._completions = {Init: self._initialised, Update: self.data.updated,
                             Resolve: self._resolved,
                             Exclusive: lambda d: self.saves.settle(self.scheduler.saved(d))}
        self._handlers = {Hello: self._hello, InitLayer: self._init,
                          Fetch: self.data.fetch, PushGrad: self.data.push, Bye: self._bye,
                          StashArena: self._stash_arena, Status: self._status,
                          SetHyper: self._set_hyper, Save: self._save,
                          Heartbeat: self._heartbeat}

    # ------------------------------------------------------------------------- entry points

    def handle(self, peer: bytes, msg: Message, frames: list, key: bytes = b"") -> list[Out]:
        """One decoded request (``key``: the peer's CURVE public key); the replies due now."""
        handler = self._handlers.get(type(msg))
        self.peers.seen(peer)
        try:
            if handler is None:
                raise RequestError("bad_message", f"{type(msg).__name__} is not a request",
                                   "kind")
            observer = type(msg) is Hello and msg.role == "observer"  # l2l-ctl status
            if self.broken is not None and type(msg) not in (Status, Bye) and not observer:
                raise RequestError("internal", f"server stopped updating: {self.broken}")
            self.waiting.check(peer, msg.req_id, bounded=type(msg) not in (Status, Bye))
            outs = (self._hello(peer, msg, key) if type(msg) is Hello
                    else handler(peer, msg, frames))
            outs += self._publish_due()
        except RequestError as e:
            self.stats.busy_refusals += e.code == "busy"
            outs = [error_out(peer, msg.req_id, e.code, str(e), e.field)]
            if isinstance(e, Duplicate):
                return outs
        except Exception as e:  # a bug: report it, keep serving
            log.exception("internal error handling %s", type(msg).__name__)
            outs = [error_out(peer, msg.req_id, "internal", f"{type(e).__name__}: {e}")]
        self.waiting.note(peer, msg.req_id, outs)
        return self.waiting.answered(outs)

    def poll(self) -> list[Out]:
        """Take in the engines' finished jobs; the replies they made due."""
        outs, self._orphans = self._orphans, []
        while True:
            try:
                done = self._done.get_nowait()
            except queue.Empty:
                return self.waiting.answered(outs)
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
        if self.engines.boxes is not None:  # no engine is left waiting for its turn
            self.engines.boxes.stop()
        self.engines.close()
        self.pool.close()
        try:
            if final_save and self.cfg.save and self.store.initialised:
                self.saves.final(lambda: self.scheduler.final_checkpoint(self.cfg.save),
                                 self.store.step, self.cfg.save)
        finally:
            self.store.close()

    # ------------------------------------------------------------------------- helpers

    def _on_done(self, done: Done) -> None:  # an engine thread (or inline: the caller)
        self._done.put(done)
        self._wake()

    def _break(self, why: str, level: int = logging.ERROR) -> list[Out]:
        """An update failed (or a worker was lost for good): stop updating; every waiting
        Fetch, every held gradient and every Save waiting for its boundary gets an internal
        Error."""
        log.log(level, "server stopped updating: %s", why)
        self.broken = why
        return (self.data.fail_waiters(None, "internal", why) +
                self.data.fail_held("internal", why) +
                [error_out(w.peer, w.req_id, "internal", why)
                 for w in self.scheduler.abandon_saves()])

    # ------------------------------------------------------------------------- handshake

    def expire(self) -> list[Peer]:
        """Declare the peers silent for the heartbeat timeout dead (their ranks are free, their
        waiting Fetches dropped); returns them and those a Hello found dead since."""
        self._expire()
        lost, self._lost = self._lost, []
        return lost

    def excuse(self, seconds: float) -> None:
        """The server did not run for ``seconds``: no peer is blamed for that silence."""
        self.peers.excuse(seconds)

    def _expire(self) -> None:
        for peer, why in self.peers.expire():
            try:
                self._gone(peer, why)
            except Exception:  # a bug: the other dead peers must still be let go
                log.exception("internal error letting rank %d go", peer.rank)

    def _gone(self, peer: Peer, why: str) -> None:
        if peer.worker:
            log.warning("rank %d (pid %d) declared dead: %s", peer.rank, peer.pid, why)
        else:  # a control client that left without Bye: routine
            log.info("observer (pid %d) gone: %s", peer.pid, why)
        self.data.board.drop(peer.identity)  # nobody reads those replies
        self.waiting.forget(peer.identity)
        self._lost.append(peer)
        if peer.worker:
            self._orphans += self._stranded(peer.rank)
            if self._orphans:
                self._wake()  # poll() sends them

    def _stranded(self, rank: int, level: int = logging.ERROR) -> list[Out]:
        """``rank`` left mid-step and no replacement can redo its part (no previous versions
        kept, see _hello): the others would wait for it until their timeout, so the server
        stops, and tells them why."""
        if self.store.retained_region is not None or self.broken is not None:
            return []
        step, pushed = self.data.resume_point(rank)
        if not self._mid_step(step, pushed):
            return []
        return self._break(f"rank {rank} left in the middle of step {step} ({len(pushed)} "
                           "of its layers pushed) and this server keeps no previous versions "
                           "(--recovery), so no replacement can redo its part: the job cannot "
                           f"finish; {self.saves.resume_hint()}", level)

    def _mid_step(self, step: int, pushed: tuple[int, ...]) -> bool:
        """A rank at this resume point (data.resume_point) has pushed part of its step."""
        return bool(pushed) or max(self.store.versions) > step

    def _all_done(self, rank: int, done: bool) -> bool:
        """A Bye's ``done``, unless its rank has pushed only part of its step (done: all of
        it)."""
        return done and not (0 <= rank < self.cfg.world_size and self._mid_step(
            *self.data.resume_point(rank)))

    def _heartbeat(self, identity: bytes, msg: Heartbeat, frames) -> list[Out]:
        peer = self.peers.get(identity)
        if msg.report is not None and peer.worker:
            peer.report = msg.report
        return [Out(identity, Ack(req_id=msg.req_id))]

    def _hello(self, identity: bytes, msg: Hello, key: bytes) -> list[Out]:
        held = self.peers.get(identity) if identity in self.peers else None
        if held is not None and held.worker and (msg.role == "observer" or msg.rank not in (
                held.rank, ANY_RANK)):  # (its rank would vanish unaccounted for)
            raise RequestError("bad_request", f"this connection is rank {held.rank}: another "
                               "role or rank needs a connection of its own", "rank")
        if msg.role == "observer":
            check_hello(self.cfg, msg)
            self.peers.register(Peer.observer(identity, msg.pid, key))
            return [Out(identity, Ack(req_id=msg.req_id))]
        grad_dtype = check_hello(self.cfg, msg)
        check_model(self.store, msg)
        self._expire()  # a holder silent past the timeout is gone now, not at the next tick
        # Before any registration: a failure here changes nothing.
        rank = self.peers.free_rank(identity) if msg.rank == ANY_RANK else msg.rank
        self.peers.check_free(rank, identity, key, msg.process)
        rejoined = rank in self.peers.ever
        step, pushed = self.data.resume_point(rank)
        if self.store.retained_region is None and self._mid_step(step, pushed):
            raise RequestError("bad_request", f"rank {rank} cannot redo step {step} exactly: "
                               "its predecessor pushed layers of it, which may be updated while "
                               "they are read again, and this server keeps no previous "
                               "versions (start it with --recovery); "
                               f"{self.saves.resume_hint('the job')}")
        self.scheduler.data.check(msg.samples_per_step)
        init_layers = ()
        if rank == self.initialiser:  # a restarted initialiser finishes the job
            init_layers = tuple(i for i, v in enumerate(self.store.versions)
                                if v < 0 and i not in self.initialising)
        # A replacement gets new gradient slots: the old ones may still be read by reductions.
        transport = make_transport(msg.transport, self.store, rank, grad_dtype,
                                   self.cfg.grad_slots, fresh=rejoined)
        outs = []
        replaced = self.peers.register(Peer(identity, rank, transport, grad_dtype, msg.pid,
                                            key, host=msg.host, process=msg.process))
        if replaced is not None:
            outs += self.data.fail_waiters(replaced.identity, "bad_request",
                                           f"rank {rank} was replaced")
        data_step, data_samples = self.scheduler.data.joined(msg.samples_per_step)
        log.info("hello from rank %d (pid %d, %s, %s)%s", rank, msg.pid, msg.host,
                 msg.transport, f": resumes step {step}, {len(pushed)} layers of it pushed "
                 "already" if rejoined else "")
        return outs + [Out(identity, Welcome(
            req_id=msg.req_id, protocol_version=PROTOCOL_VERSION, run_id=self.run_id,
            step=step, init_layers=init_layers, pushed=pushed, rejoined=rejoined,
            heartbeat_interval=self.cfg.heartbeat_timeout / 4,
            compute_dtype=self.cfg.compute_dtype, grad_dtype=grad_dtype,
            master=self.store.master_info(), compute=self.store.compute_info(),
            grad_slots=self.cfg.grad_slots, grad_slot_numel=self.store.layout.max_trainable_numel,
            world_size=self.cfg.world_size, optimizer=self.cfg.optimizer.as_dict(),
            rank=rank, data_step=data_step, data_samples=data_samples, **transport.welcome()))]

    def _init(self, identity: bytes, msg: InitLayer, frames) -> list[Out]:
        peer = self.peers.worker(identity)
        self.data.check_layer(msg.layer)
        if peer.rank != self.initialiser:
            raise RequestError("bad_request", f"rank {peer.rank} is not the initialising worker "
                               f"(rank {self.initialiser})", "layer")
        data, tail = initial_values(frames[0], self.store.plan(msg.layer), msg.frozen_dtype,
                                    self.store.compute_dtype)
        if self.store.versions[msg.layer] >= 0 or msg.layer in self.initialising:
            raise RequestError("bad_request", f"layer {msg.layer} is initialised", "layer")
        self.initialising.add(msg.layer)
        self.engines.submit(Init(msg.layer, data, Requester(identity, msg.req_id), tail))
        return []

    def _initialised(self, done: Done) -> list[Out]:
        job: Init = done.job
        who = job.requester
        self.initialising.discard(job.layer)
        if done.error is not None:
            return [error_out(who.peer, who.req_id, "internal",
                              f"{type(done.error).__name__}: {done.error}")]
        if done.result:  # (why the values are refused)
            return [error_out(who.peer, who.req_id, "bad_request", f"initial values of layer "
                              f"{job.layer} {done.result}", "frames")]
        return [Out(who.peer, Ack(req_id=who.req_id)), *self.data.publish(job.layer, 0)]

    def _complete(self, done: Done) -> list[Out]:
        """An engine's job is done: the replies it makes due (one handler per job type)."""
        return self._completions[type(done.job)](done) + self._publish_due()

    def _resolved(self, done: Done) -> list[Out]:
        if done.error is not None:
            return self._break(f"update of layer {done.job.layer} failed: "
                               f"{type(done.error).__name__}: {done.error}")
        self.scheduler.resolved(done)
        return []

    def _publish_due(self) -> list[Out]:
        """Publish the versions due; publishing may make more due (an early skip counted,
        a step decided): until none is."""
        outs: list[Out] = []
        while due := self.scheduler.due():
            for p in due:
                outs += self.data.publish(p.layer, p.version)
        return outs

    def _bye(self, identity: bytes, msg: Bye, frames) -> list[Out]:
        if identity not in self.peers and self.peers.late_bye(
                identity, msg.rank, self._all_done(msg.rank, msg.done)):
            return [Out(identity, Ack(req_id=msg.req_id))]
        peer = self.peers.get(identity)
        if peer.worker and msg.rank != peer.rank:
            raise RequestError("bad_request", f"this peer is rank {peer.rank}, not {msg.rank}",
                               "rank")
        done = self._all_done(peer.rank, msg.done) if peer.worker else msg.done
        self.peers.leave(identity, done)
        outs = self.data.fail_waiters(identity, "bad_request", f"rank {peer.rank} said Bye")
        if peer.worker and not done:  # a failure, or a job being stopped: a warning
            outs += self._stranded(peer.rank, logging.WARNING)
        return outs + [Out(identity, Ack(req_id=msg.req_id))]
