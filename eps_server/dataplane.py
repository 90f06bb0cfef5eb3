"""Weights out and gradients in (part of the core: no I/O, no threads): Fetches and the ones
waiting for a version, pushes and their reduction, and publishing each layer's next version.

A Fetch is answered at once when its version exists, else it waits on the version board. A
push is checked, claimed for its rank and held where it lies (its slot or frame, unanswered);
the last rank's part makes the layer due for its update (scheduler.py), which reads them all
and then acknowledges each (its slot is the worker's again); its completion publishes the next
version, at once or once the step is decided.

Recovery (--recovery): an update first copies the version it replaces to the store's retained
copy, so version v of a layer stays readable until the layer reaches v+2. A worker replacing a
dead one resumes the step that one was in (``resume_point``): it fetches that step's versions
(retained where the layer moved on) and pushes only the layers its rank has not pushed yet.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from protocol.messages import Fetch, GradAck, LayerReady, PushGrad

from .config import ServerConfig
from .contributions import Contributions
from .engines import Engines
from .errors import RequestError
from .jobs import Done, Part, PushTicket, Update
from .layer_store import LayerStore
from .peers import Peers
from .replies import Copies, Out, error_out
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
        self.board = VersionBoard(store, gate_on_step=cfg.loss_scaling,
                                  retained=scheduler.retained)
        self.parts = Contributions(store.num_layers, cfg.world_size)  # this step's pushes
        self._held: list[dict[int, Part]] = [{} for _ in range(store.num_layers)]  # by rank
        self.stopped: str | None = None  # why the server stopped updating
        self.published_at: list[float | None] = [None] * store.num_layers  # peers' clock
        self.copies = Copies()  # master frames made and not yet sent

    def check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.store.num_layers:
            raise RequestError("bad_request",
                               f"layer {layer} out of range [0, {self.store.num_layers})", "layer")

    # ------------------------------------------------------------------------- weights

    def fetch(self, identity: bytes, msg: Fetch, frames=()) -> list[Out]:
        peer = self.peers.worker(identity)
        self.check_layer(msg.layer)
        if msg.which != "compute" and self.store.sharding is not None and \
                self.store.compute_dtype != "float32":
            raise RequestError("bad_request", "in --eps-mode shard the fp32 master is spread "
                               "over the boxes: export the final checkpoint (--server-save) "
                               "with l2l-export", "which")
        if msg.which != "compute" and not self.store.whole_master:
            self.copies.check(identity)  # (each is made for this request: bounded)
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
            if want == current and self.parts.has(layer, peer.rank) and (
                    layer in self.scheduler.retained or layer not in self.scheduler.rewriting):
                # A replacement redoing its step reads a layer its rank pushed: the update may
                # be sent any time, so it reads a copy, made now while no job rewrites the
                # layer (the retained version, current-1, is nobody's any more), or already
                # made by the job that rewrote it (a speculative update waiting for the step's
                # decision, which needs this replacement's gradients). While that job runs, it
                # waits for it.
                if layer not in self.scheduler.retained:
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

    def _master_frame(self, identity: bytes, msg: Fetch, version: int) -> Out:
        """The fp32 master of a layer the master region does not hold whole: its trainable
        part from the master, its frozen tensors from the served copy (shard mode in fp32:
        the served copy, the same values), assembled and sent as a frame (``trained``: the
        trainable part alone)."""
        store, plan = self.store, self.store.plan(msg.layer)
        served = store.compute(msg.layer)
        flat = (served[:plan.trainable] if msg.which == "trained" else served).float()
        if store.sharding is None:
            flat[:plan.trainable] = store.master(msg.layer)
        self.stats.bytes_served_frames += flat.numel() * 4
        frame = flat.view(torch.uint8).numpy()  # (what ZeroMQ holds until it is sent)
        self.copies.track(identity, frame)
        return Out(identity, LayerReady(
            req_id=msg.req_id, layer=msg.layer, version=version, region="", offset=0,
            nbytes=flat.numel() * 4, dtype="float32",
            loss_scale=self.scheduler.scaler.scale), [frame.data])

    def _layer_ready(self, identity: bytes, msg: Fetch, retained: bool = False) -> Out:
        peer, plan, store = self.peers.get(identity), self.store.plan(msg.layer), self.store
        version = store.versions[msg.layer]
        start, nbytes = None, None  # (the whole layer)
        if self._retaining(msg) and (retained or msg.min_version == version - 1):
            region, dtype, version = store.retained_region, store.compute_dtype, msg.min_version
        elif msg.which == "trained" and store.sharding is None:  # the master's, back to back
            region, dtype = store.master_region, "float32"
            start, nbytes = 4 * store.shard_plans[msg.layer].offset, 4 * plan.trainable
        elif msg.which != "compute" and not store.whole_master:
            return self._master_frame(identity, msg, version)
        elif msg.which != "compute" or store.compute_region is None:
            region, dtype = store.master_region, "float32"
        else:
            region, dtype = store.compute_region, store.compute_dtype
        if start is None:
            start, nbytes = plan.byte_offset(dtype), plan.nbytes(dtype)
            if msg.which == "trained":
                nbytes = plan.trainable * 4
        name, offset, out = peer.transport.layer_out(region, start, nbytes)
        self.stats.fetches += 1
        if out:
            self.stats.bytes_served_frames += nbytes
        else:
            self.stats.bytes_served_shm += nbytes
        return Out(identity, LayerReady(
            req_id=msg.req_id, layer=msg.layer, version=version, region=name,
            offset=offset, nbytes=nbytes, dtype=dtype,
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
        completed = self.board.set(layer, version)
        self.scheduler.published(layer, version)
        if completed:
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

    def fail_held(self, code: str, why: str) -> list[Out]:
        """The server stops updating: every gradient held for a layer's update (here, or in
        an Update a checkpoint holds back) is answered with an Error (its rank would wait for
        an ack that never comes), and so is every one an Update still running hands back."""
        self.stopped = why
        parts = [p for held in self._held for p in held.values()]
        parts += [p for job in self.scheduler.drop_held_updates() for p in job.parts]
        self._held = [{} for _ in self._held]
        self.stats.reducing -= len(parts)
        return [error_out(p.ticket.peer, p.ticket.req_id, code, why) for p in parts]

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
        # Held where it lies (slot or frame; no copy, no ack) until every rank's part is in:
        # the layer's update reads them all at once.
        held = self._held[msg.layer]
        held[peer.rank] = Part(src, PushTicket(identity, msg.req_id, peer.rank, msg.step,
                                               msg.layer, msg.slot, bool(frames)))
        if len(held) == self.cfg.world_size:
            self._held[msg.layer] = {}
            self.scheduler.reduced(msg.layer, msg.step, tuple(held[r] for r in sorted(held)))
        return []

    def _skip(self, identity: bytes, msg: PushGrad, frames) -> list[Out]:
        """LayerDrop: no gradient; once every rank skipped the layer, its version advances
        without an update. All ranks skip the same layers, or the step is refused. A skip may
        name the step after the layer's current version (contributions.py)."""
        if frames:
            raise RequestError("bad_request", "a skip carries no gradient", "frames")
        ack = [Out(identity, GradAck(req_id=msg.req_id, step=msg.step, layer=msg.layer,
                                     slot=-1))]
        version = self.store.versions[msg.layer]
        if msg.step > version:  # the layer is not there yet: it waits (after this rank's part
            self.parts.skip_early(msg.layer, msg.rank, first=version < 0)  # of the step)
            return ack
        self.parts.claim(msg.layer, msg.rank, skip=True)
        if self.parts.add(msg.layer):
            self.scheduler.skipped(msg.layer, msg.step)
        return ack

    def updated(self, done: Done) -> list[Out]:
        """A layer's Update finished: every part is answered, its slot given back (a GradAck),
        or refused (an Error: nothing was applied, that rank may push again; the others'
        parts wait for it); the scheduler learns what the update found."""
        outs = self._answer(done)
        if done.error is None:
            self.scheduler.updated(done)
            layer, s = done.job.layer, self.scheduler
            if layer not in s.rewriting and layer not in s.retained and \
                    self.board.waits_for_copy(layer):  # held, not rewritten: copy it now
                self.store.retain(layer)
                s.retained.add(layer)
            outs += [self._layer_ready(w.peer, w.request, w.retained)
                     for w in self.board.answerable()]  # a retained copy is ready (recovery)
        return outs

    def _answer(self, done: Done) -> list[Out]:
        job: Update = done.job
        parts = job.parts
        if done.error is not None:
            self.stats.reducing -= len(parts)
            for p in parts:
                self.parts.release(job.layer, p.ticket.rank)
            why = f"{type(done.error).__name__}: {done.error}"
            return [error_out(p.ticket.peer, p.ticket.req_id, "internal", why)
                    for p in parts] + self.stop_updating(f"update of layer {job.layer} "
                                                         f"failed: {why}")
        checked = done.result.checked
        if checked.finite or self.cfg.loss_scaling:  # (an fp16 overflow skips the step)
            return self._acked(job)
        field = "frames" if parts[0].ticket.framed else "slot"
        if checked.overflow:  # finite gradients whose sum is not: the step cannot complete
            why = (f"the sum of layer {job.layer}'s gradients at step {job.t} is not finite "
                   "(finite gradients overflowed together); the layer is left as it was")
            self.stats.reducing -= len(parts)
            return [error_out(p.ticket.peer, p.ticket.req_id, "bad_request", why, field)
                    for p in parts] + self.stop_updating(why)
        outs = []
        for k, p in enumerate(parts):
            if k in checked.refused:  # nothing was added: that rank may push again
                self.stats.reducing -= 1
                self.parts.release(job.layer, p.ticket.rank)
                outs.append(error_out(
                    p.ticket.peer, p.ticket.req_id, "bad_request", f"non-finite gradient for "
                    f"layer {job.layer} from rank {p.ticket.rank} at step {job.t}; not "
                    "applied", "frames" if p.ticket.framed else "slot"))
            elif self.stopped is not None:  # nobody may push again: no update will read it
                self.stats.reducing -= 1
                outs.append(error_out(p.ticket.peer, p.ticket.req_id, "internal",
                                      f"server stopped updating: {self.stopped}"))
            else:
                self._held[job.layer][p.ticket.rank] = p
        return outs

    def _acked(self, job: Update) -> list[Out]:
        outs = []
        for p in job.parts:
            t = p.ticket
            self.stats.reducing -= 1
            self.stats.pushes += 1
            self.stats.bytes_reduced += p.nbytes
            if t.framed:
                self.stats.bytes_received_frames += p.nbytes
            else:
                self.stats.bytes_received_shm += p.nbytes
            outs.append(Out(t.peer, GradAck(req_id=t.req_id, step=t.step, layer=t.layer,
                                            slot=t.slot)))
        return outs
