"""The EPS process shell: asyncio (uvloop) + ZeroMQ ROUTER. Decode, dispatch, reply; no math.

Every request is handled in its own task, so a Fetch that waits for a version never blocks
other peers. Arithmetic (reduction, updates, checkpoints) runs on a thread pool; a per-layer
lock keeps one layer's reduce/update calls in order while other layers proceed. A bad message
gets an Error reply and changes nothing; a bug in a handler gets an "internal" Error reply and
is logged; the server keeps serving.

A gradient's way: on_push -> Reducer.add (eager reduction) -> when the last worker's part is
in, stepping.py: eager: Updater.eager (update now) | deferred: Updater.deferred_stats, then
the whole step at once -> VersionBoard.set (answers the Fetches waiting for the new version).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import time
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import zmq
import zmq.asyncio

from protocol import codec
from protocol.endpoints import check_bind, remove_ipc
from protocol.messages import (
    PROTOCOL_VERSION,
    Ack,
    ArenaReady,
    Bye,
    Error,
    Fetch,
    GradAck,
    Hello,
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
from protocol.tensors import DTYPES, Manifest, manifest_difference
from protocol.trace import Tracer

from . import checkpoint
from .config import ServerConfig
from .errors import RequestError
from .layer_store import LayerStore
from .optimizers import make_optimizer
from .reducer import ReduceError, Reducer, all_finite
from .stepping import Stepping
from .updater import Updater
from .versions import VersionBoard, VersionError

log = logging.getLogger("eps_server")


@dataclass
class Peer:
    identity: bytes
    rank: int
    transport: str
    grad_dtype: str
    pid: int


class EpsServer(Stepping):
    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.run_id = cfg.run_id or secrets.token_hex(4)
        self.store: LayerStore | None = None
        self.reducer: Reducer | None = None
        self.optimizers: list = []
        self.updater: Updater | None = None
        self.board: VersionBoard | None = None
        self.locks: list[asyncio.Lock] = []
        self.peers: dict[bytes, Peer] = {}
        self.initialiser_rank: int | None = None
        self.done_ranks: set[int] = set()
        self.stats: Counter = Counter()
        self.pool = ThreadPoolExecutor(cfg.threads, thread_name_prefix="eps-math")
        self.tracer = Tracer(cfg.trace, "eps-server")
        self._deferred: dict[int, dict] = {}  # step -> layer -> LayerStats (deferred updates)
        self._hold_from: int | None = None  # updates from this version on wait (checkpointing)
        self._committed = 0  # highest version an update under way will reach
        self._released: asyncio.Event | None = None
        self._broken: str | None = None
        self._stop: asyncio.Event | None = None
        self._tasks: set[asyncio.Task] = set()
        self._last_step_time = time.perf_counter()
        self.handlers = {Hello: self.on_hello, InitLayer: self.on_init, Fetch: self.on_fetch,
                         PushGrad: self.on_push, Save: self.on_save, Status: self.on_status,
                         Bye: self.on_bye, StashArena: self.on_stash_arena,
                         SetHyper: self.on_set_hyper}
        torch.set_num_threads(cfg.threads)

    # ------------------------------------------------------------------------- model

    def _create_model(self, manifest: Manifest) -> None:
        """Everything the model needs, or nothing (a failure, e.g. shared memory full, leaves
        the server without a model and without leftover regions)."""
        store = LayerStore(manifest, self.run_id, self.cfg.compute_dtype)
        try:
            reducer = Reducer(store.layout, self.cfg.world_size)
            compute = store.compute_region is not None
            optimizers = [
                make_optimizer(plan, store.master(plan.index), reducer.grads[plan.index],
                               store.compute(plan.index) if compute else None,
                               self.cfg.optimizer)
                for plan in store.layout.layers]
        except BaseException:
            store.close()
            raise
        self.store, self.reducer, self.optimizers = store, reducer, optimizers
        self.updater = Updater(self.cfg, reducer, optimizers)
        self.board = VersionBoard(store, gate_on_step=self.cfg.loss_scaling)
        self.locks = [asyncio.Lock() for _ in store.layout.layers]
        log.info("model: %d layers, %.2fM parameters, manifest %s", store.num_layers,
                 manifest.num_params / 1e6, store.manifest_hash[:19])

    def load(self, path: str) -> None:
        loaded = checkpoint.read_meta(path)
        self._create_model(loaded.manifest)
        checkpoint.load_into(loaded, self.store, self.optimizers)
        step = int(loaded.state["step"])
        saved = loaded.state.get("optimizer", {})
        if saved and saved != self.cfg.optimizer.as_dict():
            log.warning("the checkpoint was trained with optimizer settings %s; continuing with "
                        "the ones given now: %s", saved, self.cfg.optimizer.as_dict())
        scaler = loaded.state.get("loss_scaler", {})
        self.updater.scaler.scale = scaler.get("scale", self.updater.scaler.scale)
        self.updater.scaler.good_steps = scaler.get("good_steps", 0)
        for layer in range(self.store.num_layers):
            self.store.publish(layer)
            self.store.set_version(layer, step)
        log.info("resumed from %s at step %d", loaded.path, step)

    # ------------------------------------------------------------------------- serving

    async def serve(self, ready_line: bool = True) -> None:
        self._stop = asyncio.Event()
        self._released = asyncio.Event()
        self._released.set()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # first: a stop during --load still cleans up
            try:
                loop.add_signal_handler(sig, self._stop.set)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                pass
        if self.cfg.save:
            checkpoint.check_target(self.cfg.save)  # refuse before training, not after
        check_bind(self.cfg.endpoint)
        if self.cfg.load:
            await loop.run_in_executor(self.pool, self.load, self.cfg.load)
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 1000)
        remove_ipc(self.cfg.endpoint)  # a stale socket file from a killed server
        sock.bind(self.cfg.endpoint)
        self.sock = sock
        if ready_line:
            print(f"EPS_READY endpoint={self.cfg.endpoint} run_id={self.run_id} pid={os.getpid()}",
                  flush=True)
        log.info("listening on %s (world size %d, %s, %s updates)", self.cfg.endpoint,
                 self.cfg.world_size, self.cfg.precision, self.cfg.update)
        receiver = asyncio.create_task(self._receive())
        try:
            await self._stop.wait()
        finally:
            receiver.cancel()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(receiver, *self._tasks, return_exceptions=True)
            await self._shutdown_save()
            if ready_line:
                print("EPS_STATS " + json.dumps(self.stats_snapshot()), flush=True)
            sock.close()
            ctx.term()
            remove_ipc(self.cfg.endpoint)
            self.close()

    def close(self) -> None:
        """Release threads, then shared memory (idempotent; also called on abnormal exit). A
        running reduction or update finishes first: its tensors view the regions."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.store is not None:
            self.store.close()
        self.tracer.close()

    async def _receive(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            self._spawn(self._handle(frames[0].bytes, frames[1:]))

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, identity: bytes, frames: list) -> None:
        self.stats["messages"] += 1
        try:
            msg, tensor_frames = codec.decode(frames)
        except codec.DecodeError as e:
            self.stats["bad_messages"] += 1
            log.warning("bad message from %s: %s", identity.hex(), e)
            code, text, field = "bad_message", str(e), e.field
            version = codec.peek(frames, "protocol_version", kind=Hello)
            if version is not None and version != PROTOCOL_VERSION:
                # Another version's Hello may not even decode: report the version first.
                code, text, field = "protocol_version", _version_text(version), "protocol_version"
            await self._send(identity, Error(req_id=codec.peek_req_id(frames), code=code,
                                             message=text, field=field))
            return
        handler = self.handlers.get(type(msg))
        try:
            if handler is None:
                raise RequestError("bad_message", f"{type(msg).__name__} is not a request",
                                   "kind")
            if self._broken is not None and type(msg) not in (Status, Bye):
                raise RequestError("internal", f"server stopped updating: {self._broken}")
            reply, out_frames = await handler(identity, msg, tensor_frames)
        except RequestError as e:
            reply, out_frames = Error(req_id=msg.req_id, code=e.code, message=str(e),
                                      field=e.field), ()
        except VersionError as e:
            reply, out_frames = Error(req_id=msg.req_id, code=e.code, message=str(e)), ()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug: report it, keep serving
            log.exception("internal error handling %s", type(msg).__name__)
            reply, out_frames = Error(req_id=msg.req_id, code="internal",
                                      message=f"{type(e).__name__}: {e}"), ()
        await self._send(identity, reply, out_frames)

    async def _send(self, identity: bytes, msg: Message, frames=()) -> None:
        await self.sock.send_multipart([identity, *codec.encode(msg, frames)], copy=False)

    async def _math(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # ------------------------------------------------------------------------- helpers

    def _peer(self, identity: bytes) -> Peer:
        peer = self.peers.get(identity)
        if peer is None:
            raise RequestError("not_registered", "say Hello first")
        return peer

    def _control(self, identity: bytes) -> None:
        """Control requests (Save, SetHyper) come from this job's workers, or over ipc, where
        the socket directory's permissions already restrict peers to this user."""
        if identity not in self.peers and not self.cfg.endpoint.startswith("ipc://"):
            raise RequestError("not_registered", "control requests over tcp need a Hello first")

    def _layer(self, layer: int) -> None:
        if self.store is None:
            raise RequestError("not_ready", "the server has no model yet")
        if not 0 <= layer < self.store.num_layers:
            raise RequestError("bad_request",
                               f"layer {layer} out of range [0, {self.store.num_layers})", "layer")

    # ------------------------------------------------------------------------- handshake

    async def on_hello(self, identity: bytes, msg: Hello, frames):
        if msg.protocol_version != PROTOCOL_VERSION:
            raise RequestError("protocol_version", _version_text(msg.protocol_version),
                               "protocol_version")
        if msg.world_size != self.cfg.world_size:
            raise RequestError("bad_request", f"server world size is {self.cfg.world_size}, "
                               f"worker says {msg.world_size}", "world_size")
        grad_dtype = self.cfg.compute_dtype if msg.grad_dtype == "compute" else msg.grad_dtype
        if grad_dtype not in ("float32", self.cfg.compute_dtype):
            raise RequestError("bad_request", f"grad_dtype must be float32 or "
                               f"{self.cfg.compute_dtype}", "grad_dtype")
        if self.store is None:
            if msg.manifest is None:
                raise RequestError("not_ready", "the server has no model yet: the first worker "
                                   "must send its manifest", "manifest")
            if msg.manifest.hash() != msg.manifest_hash:
                raise RequestError("bad_request", "manifest_hash does not match the manifest",
                                   "manifest_hash")
            try:
                self._create_model(msg.manifest)
            except (OSError, RuntimeError, ValueError) as e:
                raise RequestError("internal", f"cannot hold this model: {e}") from None
            self.initialiser_rank = msg.rank
        elif msg.manifest_hash != self.store.manifest_hash:
            head = (f"model mismatch: the server holds {self.store.manifest_hash[:19]}.. "
                    f"({self.store.num_layers} layers, {self.store.manifest.num_params} params)"
                    f", worker rank {msg.rank} has {msg.manifest_hash[:19]}..")
            diff = manifest_difference(self.store.manifest, msg.manifest) if msg.manifest else ""
            raise RequestError("manifest_mismatch", f"{head}: {diff}" if diff else head,
                               "manifest_hash")
        init_layers = ()
        if msg.rank == self.initialiser_rank:  # a restarted initialiser finishes the job
            init_layers = tuple(i for i, v in enumerate(self.store.versions) if v < 0)
        grads = None
        if msg.transport == "shm":  # before any registration: a failure here changes nothing
            try:
                region = self.store.grad_region(msg.rank, grad_dtype, self.cfg.grad_slots)
            except OSError as e:
                raise RequestError("internal", f"cannot create gradient slots: {e}") from None
            grads = RegionInfo(name=region.name, nbytes=region.nbytes, dtype=grad_dtype)
        for old_identity, old in list(self.peers.items()):
            if old.rank == msg.rank and old_identity != identity:
                log.warning("rank %d reconnected (pid %d replaces pid %d)", msg.rank, msg.pid,
                            old.pid)
                del self.peers[old_identity]
                self.board.fail(old_identity, "bad_request", f"rank {msg.rank} was replaced")
        self.peers[identity] = Peer(identity, msg.rank, msg.transport, grad_dtype, msg.pid)
        self.done_ranks.discard(msg.rank)
        log.info("hello from rank %d (pid %d, %s, %s)", msg.rank, msg.pid, msg.host,
                 msg.transport)
        return Welcome(
            req_id=msg.req_id, protocol_version=PROTOCOL_VERSION, run_id=self.run_id,
            step=max(self.store.step, 0), init_layers=init_layers,
            compute_dtype=self.cfg.compute_dtype, grad_dtype=grad_dtype,
            master=self.store.master_info(), compute=self.store.compute_info(), grads=grads,
            grad_slots=self.cfg.grad_slots, grad_slot_numel=self.store.layout.max_layer_numel,
            world_size=self.cfg.world_size, optimizer=self.cfg.optimizer.as_dict(),
            versions=self.store.versions_info() if msg.transport == "shm" else None), ()

    async def on_init(self, identity: bytes, msg: InitLayer, frames):
        peer = self._peer(identity)
        self._layer(msg.layer)
        if peer.rank != self.initialiser_rank:
            raise RequestError("bad_request", f"rank {peer.rank} is not the initialising "
                               f"worker (rank {self.initialiser_rank})", "layer")
        plan = self.store.plan(msg.layer)
        data = _frame_tensor(frames[0], "float32", plan.numel)

        def write() -> bool:
            if not all_finite(data):
                return False
            self.store.master(msg.layer).copy_(data)
            self.store.publish(msg.layer)
            return True

        async with self.locks[msg.layer]:
            if self.store.versions[msg.layer] >= 0:
                raise RequestError("bad_request", f"layer {msg.layer} is already initialised",
                                   "layer")
            if not await self._math(write):
                raise RequestError("bad_request", f"initial values of layer {msg.layer} are not "
                                   "all finite", "frames")
        self._publish(msg.layer, 0)
        return Ack(req_id=msg.req_id), ()

    # ------------------------------------------------------------------------- weights

    async def on_fetch(self, identity: bytes, msg: Fetch, frames):
        peer = self._peer(identity)
        self._layer(msg.layer)
        current = self.store.versions[msg.layer]
        if msg.min_version > current + 1:
            raise RequestError("bad_request", f"layer {msg.layer} is at version {current}; "
                               f"version {msg.min_version} is more than one step ahead",
                               "min_version")
        if msg.min_version <= current and msg.layer in self.board.updating:
            raise RequestError("bad_request", f"version {current} of layer {msg.layer} is being "
                               "replaced: every worker has pushed its gradient", "min_version")
        version = await self.board.wait(identity, msg.layer, msg.min_version)
        self.stats["fetches"] += 1
        plan = self.store.plan(msg.layer)
        if msg.which == "master" or self.store.compute_region is None:
            region, dtype = self.store.master_region, "float32"
        else:
            region, dtype = self.store.compute_region, self.store.compute_dtype
        offset, nbytes = plan.byte_offset(dtype), plan.nbytes(dtype)
        out = ()
        if peer.transport == "frames":
            # Zero-copy: the layer is not rewritten before this worker pushes its gradient.
            out = (region.base[offset:offset + nbytes].numpy().data,)
        return LayerReady(req_id=msg.req_id, layer=msg.layer, version=version,
                          region="" if out else region.name, offset=0 if out else offset,
                          nbytes=nbytes, dtype=dtype,
                          loss_scale=self.updater.scaler.scale), out

    # ------------------------------------------------------------------------- gradients

    async def on_push(self, identity: bytes, msg: PushGrad, frames):
        peer = self._peer(identity)
        self._layer(msg.layer)
        if msg.rank != peer.rank:
            raise RequestError("bad_request", f"this peer is rank {peer.rank}, not {msg.rank}",
                               "rank")
        version = self.store.versions[msg.layer]
        if msg.step != version:
            raise RequestError("bad_request", f"gradient for step {msg.step}, but layer "
                               f"{msg.layer} is at version {version}", "step")
        plan = self.store.plan(msg.layer)
        if msg.dtype != peer.grad_dtype:
            raise RequestError("bad_request", f"this peer said Hello with grad_dtype "
                               f"{peer.grad_dtype}, not {msg.dtype}", "dtype")
        if frames:
            if msg.slot != -1:
                raise RequestError("bad_request", "slot must be -1 with a tensor frame", "slot")
            src = _frame_tensor(frames[0], msg.dtype, plan.numel)
        else:
            if peer.transport != "shm":
                raise RequestError("bad_request", "frames transport: send the gradient as a "
                                   "tensor frame", "frames")
            if not 0 <= msg.slot < self.cfg.grad_slots:
                raise RequestError("bad_request", f"slot must be in [0, {self.cfg.grad_slots})",
                                   "slot")
            src = self.store.grad_slot(peer.rank, msg.slot, msg.dtype, plan.numel)
        try:
            self.reducer.claim(msg.layer, peer.rank)
        except ReduceError as e:
            raise RequestError("bad_request", str(e), e.field) from None
        # fp16: an overflow is expected now and then and the loss scaler deals with it.
        check = not self.cfg.loss_scaling

        def reduce() -> bool:
            with self.tracer.span(f"reduce L{msg.layer} r{peer.rank}", "reduce"):
                if check and not all_finite(src):
                    return False
                self.reducer.add(msg.layer, src)
                return True

        async with self.locks[msg.layer]:
            t0 = time.perf_counter()
            try:
                ok = await self._math(reduce)
            except BaseException:
                self.reducer.release(msg.layer, peer.rank)
                raise
            self.stats["reduce_seconds"] += time.perf_counter() - t0
            if not ok:
                self.reducer.release(msg.layer, peer.rank)
                raise RequestError("bad_request", f"non-finite gradient for layer {msg.layer} "
                                   f"from rank {peer.rank} at step {msg.step}; not applied",
                                   "frames" if frames else "slot")
            complete = self.reducer.complete(msg.layer)
        self.stats["pushes"] += 1
        self.stats["bytes_reduced"] += plan.nbytes(msg.dtype)
        if complete:
            self.board.updating.add(msg.layer)
            deferred = self.cfg.update == "deferred"
            self._spawn((self._collect if deferred else self._update)(msg.layer, version))
        return GradAck(req_id=msg.req_id, step=msg.step, layer=msg.layer, slot=msg.slot), ()

    # ------------------------------------------------------------------------- control

    async def on_stash_arena(self, identity: bytes, msg: StashArena, frames):
        peer = self._peer(identity)
        if self.store is None:
            raise RequestError("not_ready", "the server has no model yet")
        try:
            region = self.store.stash_region(peer.rank, msg.nbytes)
        except OSError as e:
            raise RequestError("bad_request", f"cannot allocate a stash arena of {msg.nbytes} "
                               f"bytes: {e}", "nbytes") from None
        log.info("stash arena of %.1f MiB for rank %d", msg.nbytes / 2**20, peer.rank)
        return ArenaReady(req_id=msg.req_id, region=RegionInfo(
            name=region.name, nbytes=region.nbytes, dtype="uint8")), ()

    def stats_snapshot(self) -> dict:
        stats = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.stats.items()}
        stats.update(peak_memory_bytes(), lr=self.cfg.optimizer.lr)
        if self.store is not None:
            stats["lr_now"] = self.cfg.optimizer.lr_at(max(self.store.step, 0))
            stats.update(params=self.store.manifest.num_params,
                         loss_scale=self.updater.scaler.scale,
                         overflow_steps=len(self.updater.overflow_steps),
                         skipped_updates=self.updater.skipped_updates)
        if self._broken:
            stats["broken"] = self._broken
        return stats

    async def on_status(self, identity: bytes, msg: Status, frames):
        versions = tuple(self.store.versions) if self.store else ()
        return StatusReply(req_id=msg.req_id, run_id=self.run_id,
                           step=max(self.store.step, 0) if self.store else 0, versions=versions,
                           world_size=self.cfg.world_size,
                           ranks=tuple(sorted(p.rank for p in self.peers.values())),
                           stats=self.stats_snapshot()), ()

    async def on_bye(self, identity: bytes, msg: Bye, frames):
        peer = self._peer(identity)
        if msg.rank != peer.rank:
            raise RequestError("bad_request", f"this peer is rank {peer.rank}, not {msg.rank}",
                               "rank")
        del self.peers[identity]
        if self.board is not None:
            self.board.fail(identity, "bad_request", f"rank {peer.rank} said Bye")
        if msg.done:
            self.done_ranks.add(peer.rank)
        if self.cfg.exit_when_done and len(self.done_ranks) >= self.cfg.world_size:
            log.info("all %d workers are done; exiting once the last updates are in",
                     self.cfg.world_size)
            self._spawn(self._stop_when_settled())
        return Ack(req_id=msg.req_id), ()


def peak_memory_bytes() -> dict[str, int]:
    """This process's peak and current resident memory, shared memory included (Linux)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssShmem"):
                    out[f"{key.lower()}_bytes"] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def _version_text(client_version) -> str:
    return (f"server speaks protocol version {PROTOCOL_VERSION}, client sent "
            f"{client_version}: upgrade the older side")


def _frame_tensor(frame: memoryview, dtype: str, numel: int) -> torch.Tensor:
    want = numel * DTYPES[dtype].itemsize
    if frame.nbytes != want:
        raise RequestError("bad_request", f"tensor frame has {frame.nbytes} bytes, expected "
                           f"{want}", "frames")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only frame; never written
        return torch.frombuffer(frame, dtype=DTYPES[dtype], count=numel)
