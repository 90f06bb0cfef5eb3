"""The EPS process shell: asyncio (uvloop) + a ZeroMQ ROUTER around the core. No logic here.

Receive -> decode -> ``core.handle`` -> send its replies. The core's engines finish work on
their own threads and wake the loop, which sends what ``core.poll`` returns. A message that does
not decode gets an Error reply (a Hello of another protocol version is told so) and never
reaches the core. Until the first worker's Hello creates the model, the lobby answers.

What takes time is not done on the loop, nor waited for by the other peers: a large body (a
Hello's manifest) is decoded on a thread, and the lobby works on one; meanwhile that peer's next
messages wait in its backlog, and everyone else's are served (see inbox.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import signal
import threading
import time
from collections import deque

import torch
import zmq
import zmq.asyncio

from protocol import codec, curve
from protocol.endpoints import IpcClaim, check_bind, ipv6
from protocol.events import EventWriter, PeerLost, Ready, ServerStats
from protocol.lifecycle import process_gone
from protocol.messages import PROTOCOL_VERSION, Error, Hello, StatusReply
from protocol.shm import RunLock, remove_orphans
from protocol.tensors import DTYPES
from protocol.trace import Tracer

from . import checkpoint, kernels, metrics
from .box_status import BoxBoard
from .boxes import CrossBox
from .config import ServerConfig
from .core import EpsCore
from .inbox import Inbox, Throttled, large
from .lobby import Lobby, join_and_load
from .optimizers import STATE_DTYPES
from .peers import version_text
from .replies import Out
from .stats import EpsStats

log = logging.getLogger("eps_server")

SETTLE_TIMEOUT = 60.0  # after the last Bye(done), wait this long for the last updates
HWM = 1000  # messages queued per peer, each way (> the per-peer pending limit)


class EpsServer:
    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.run_id = cfg.run_id or secrets.token_hex(4)
        self.stats = EpsStats()
        self.tracer = Tracer(cfg.trace, "eps-server")
        self.events = EventWriter(cfg.events)
        self.core: EpsCore | None = None
        self._core_kw = {"stats": self.stats, "wake": self._wake, "tracer": self.tracer,
                         "notify": self.events.emit}
        self.lobby = Lobby(cfg, self.run_id, **self._core_kw)
        self._lobby = asyncio.Lock()
        self._lock: RunLock | None = None
        self._claim: IpcClaim | None = None  # the ipc socket file, ours while we serve
        self._serving = False  # bound: a server that never was writes no final checkpoint
        self._holds_root = False  # the --server-save lock is this server's to release
        self._auth = None  # the CURVE authenticator (ZAP handler thread), if any
        self._metrics = None  # the Prometheus endpoint's HTTP server, if any
        self._dropping: set[bytes] = set()  # peers whose replies could not be sent
        self._inbox = Inbox()  # the peers' backlogs, the decoder thread
        self._readers: set[asyncio.Task] = set()  # the tasks reading the peers' backlogs
        self._creating: asyncio.Future | None = None  # the lobby's thread making the model
        self._bad_log = Throttled()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._poller: asyncio.Task | None = None  # the task sending what core.poll returns
        self.box_lost: str | None = None  # why this EPS stopped: another box was lost
        self.board: BoxBoard | None = None  # every box's status, for Status (--nodes)
        self._settle_timer: asyncio.TimerHandle | None = None
        self._warmer: threading.Thread | None = None  # compiles the math passes at start
        torch.set_num_threads(cfg.math_threads)

    async def serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):  # first: a stop during --load cleans up
            try:
                self._loop.add_signal_handler(sig, self._stop.set)
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                pass
        if self.cfg.save:
            checkpoint.check_target(self.cfg.save)  # refuse before training, not after
        if warning := check_bind(self.cfg.endpoint, bool(self.cfg.curve_secret_key),
                                 self.cfg.insecure):
            log.warning(warning)
        curve.check_server_options(self.cfg.curve_secret_key, self.cfg.curve_clients)
        # First: a server refused here has touched nothing (regions, checkpoints) of the one
        # serving the socket.
        self._claim = IpcClaim(self.cfg.endpoint)
        box = self.cfg.boxes  # (a shard job's root is box 0's: the others write into it)
        if self.cfg.save and (box.sharding is None or box.node_rank == 0):  # made and locked:
            self._holds_root = checkpoint.hold_root(self.cfg.save)
        self._lock = RunLock(self.run_id)  # before any region: ours are never "orphaned"
        if stale := self._lock.remove_stale():
            log.warning("removed %d shared-memory regions left by an earlier server of run %s",
                        len(stale), self.run_id)
        for run, (count, size) in remove_orphans().items():
            log.warning("removed %d shared-memory regions (%.1f MiB) of run %s, left by a "
                        "server that is gone", count, size / 2**20, run)
        self.core = await asyncio.to_thread(join_and_load, self.cfg, self.run_id,
                                            self._board, **self._core_kw)
        ctx = zmq.asyncio.Context()
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an undeliverable reply is an error
        self.sock.setsockopt(zmq.SNDHWM, HWM)
        self.sock.setsockopt(zmq.RCVHWM, HWM)
        self.sock.setsockopt(zmq.HANDSHAKE_IVL, 10_000)  # ms a handshake may hold an fd
        if self.cfg.curve_secret_key:
            self._auth = curve.serve(ctx, self.sock, self.cfg.curve_secret_key,
                                     self.cfg.curve_clients)
        self.sock.setsockopt(zmq.IPV6, ipv6(self.cfg.endpoint))
        try:
            self.sock.bind(self.cfg.endpoint)
        except zmq.ZMQError as e:  # a port in use, an address not on this machine
            raise OSError(f"cannot listen on {self.cfg.endpoint}: {e}") from None
        self._serving = True  # from now on a final checkpoint is this server's to write
        self._warmer = threading.Thread(target=self._warm, name="eps-warm", daemon=True)
        self._warmer.start()
        endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)  # tcp port 0: the real one
        if self.cfg.metrics_port:
            self._metrics = metrics.serve(self.cfg.metrics_port, self.cfg.metrics_host,
                                          self.cfg.insecure, self.stats, lambda: self.core)
        self.events.emit(Ready(endpoint=endpoint, run_id=self.run_id, pid=os.getpid(),
                               step=self.core.store.step if self.core else 0))
        log.info("listening on %s (run %s, world size %d, %s, %s updates)", endpoint,
                 self.run_id, self.cfg.world_size, self.cfg.precision, self.cfg.update)
        receiver = asyncio.create_task(self._receive())
        watchdog = asyncio.create_task(self._watch_peers())
        try:
            await self._stop.wait()
        finally:
            tasks = (receiver, watchdog, *self._readers)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._creating is not None:  # its reader was cancelled, not the thread
                made = (await asyncio.gather(self._creating, return_exceptions=True))[0]
                if isinstance(made, tuple) and made[0] is not None and made[0] is not self.core:
                    made[0].close(final_save=False)  # created while stopping: undone
            self._inbox.close()
            core, self.core = self.core, None  # taken on the loop: no poll touches it again
            if self._poller is not None:
                await asyncio.gather(self._poller, return_exceptions=True)
            stats = await asyncio.to_thread(self._close, core)
            self.events.emit(ServerStats(stats=stats))
            self.events.close()
            self.sock.close()
            if self._auth is not None:
                self._auth.stop()
            if self._metrics is not None:
                self._metrics.shutdown()
            ctx.term()
            self._claim.release()  # now that our socket is closed (libzmq unlinks its file)

    def close(self) -> dict:
        """Idempotent clean-up, also after an abnormal exit (see _close)."""
        core, self.core = self.core, None
        if self._claim is not None:
            self._claim.release()
        return self._close(core)

    def _board(self) -> None:
        self.board = BoxBoard(self.cfg, self.stats, lambda: self.core)

    def _warm(self) -> None:
        """Compile the math passes while the workers start (the first step would wait)."""
        compute, boxes = self.cfg.compute_dtype, self.cfg.boxes
        grads = tuple(dict.fromkeys((DTYPES[compute], torch.float32)))
        try:  # (several boxes: one part, the boxes' fp32 sum; shard mode: a copy also in fp32)
            kernels.warm(1 if boxes.nodes > 1 else self.cfg.world_size, grads,
                         None if compute == "float32" and boxes.sharding is None
                         else DTYPES[compute], STATE_DTYPES[self.cfg.optimizer.states])
        except Exception:  # only time is lost: the first update compiles what it needs
            log.exception("compiling the math passes ahead failed")

    def _close(self, core: EpsCore | None) -> dict:
        """Stop the engines, write the final checkpoint (if asked and settled), release shared
        memory; returns the final statistics."""
        if self._warmer is not None:  # the compiler must not be running as the process exits
            self._warmer.join()
            self._warmer = None
        stats = self.stats.snapshot()
        if core is not None:
            core.close(final_save=self._serving)
            stats = core.status_stats()
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if self._holds_root:
            checkpoint.release_root(self.cfg.save)
            self._holds_root = False
        if self.board is not None:
            self.board.close(core)
        CrossBox.close()
        self.tracer.close()
        return stats

    # ------------------------------------------------------------------------- messages

    async def _receive(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            try:
                await self._take(frames[0].bytes, frames[1:])
            except Exception:  # a bug: never stop receiving because of one message
                log.exception("internal error serving a message")

    async def _take(self, identity: bytes, frames: list) -> None:
        """Serve a message now, or have it read off the loop: a large body, or no model yet
        (the lobby). Behind it, the peer's next ones wait in its backlog (a full one refuses
        them as busy, unread); other peers are served meanwhile."""
        backlog = self._inbox.backlogs.get(identity)
        if backlog is None and self.core is not None and not large(frames):
            await self._send(await self._dispatch(identity, frames))  # never waits here
            self._check_exit()
        elif backlog is None:
            self._inbox.backlogs[identity] = deque((frames,))
            reader = self._loop.create_task(self._read(identity))
            self._readers.add(reader)
            reader.add_done_callback(self._readers.discard)
        elif not self._inbox.full(backlog):
            backlog.append(frames)
        else:
            self.stats.messages += 1
            self.stats.busy_refusals += 1
            await self._send([Out(identity, Error(
                req_id=codec.request_id(frames), code="busy", field="",
                message=f"{len(backlog)} messages of this connection wait to be read; retry "
                        "once they are answered"))])

    async def _read(self, identity: bytes) -> None:
        """Serve a peer's backlog in order (each stays in it while it is served)."""
        backlog = self._inbox.backlogs[identity]
        try:
            while backlog:
                try:
                    await self._send(await self._dispatch(identity, backlog[0]))
                    self._check_exit()
                except Exception:  # a bug: the peer's next messages are still served
                    log.exception("internal error serving a message")
                backlog.popleft()
        finally:
            del self._inbox.backlogs[identity]

    async def _watch_peers(self) -> None:
        """Declare silent peers dead, a few times per heartbeat timeout; the launcher hears of
        each lost worker (it may stop a hung one and start a replacement)."""
        interval = min(1.0, self.cfg.heartbeat_timeout / 4)
        last = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            late, last = now - last - interval, now
            if self.core is None:
                continue
            try:
                if late > interval:  # the EPS did not run (SIGSTOP, a paused VM, swapping):
                    log.warning("the EPS did not run for %.1f s; peers are not blamed for that "
                                "silence", late)  # their messages wait unread in the socket
                    self.core.excuse(late)
                for peer in self.core.expire():
                    if peer.worker:
                        self.events.emit(PeerLost(
                            rank=peer.rank, pid=peer.pid, exited=process_gone(peer.process),
                            silent=round(time.monotonic() - peer.last_seen, 3)))
                self._check_exit()
            except Exception:  # a bug: the watch must go on, or nobody is ever declared dead
                log.exception("internal error watching the peers")

    async def _dispatch(self, identity: bytes, frames: list) -> list[Out]:
        self.stats.messages += 1
        key = curve.peer_key(frames) if self._auth is not None else b""
        try:  # only a Hello's body may be large: decoding it never stalls the loop
            msg, tensor_frames = (await self._decode_large(identity, frames) if large(frames)
                                  else codec.decode(frames))
        except codec.DecodeError as e:
            self.stats.bad_messages += 1
            self._bad_log.warn("bad message from %s: %s", identity.hex(), e)
            return [Out(identity, decode_error(frames, e))]
        if self.core is not None:
            return self.core.handle(identity, msg, tensor_frames, key)
        async with self._lobby:  # creating a model (shared memory) takes time: off the loop
            if self.core is not None:
                return self.core.handle(identity, msg, tensor_frames, key)
            self._creating = asyncio.ensure_future(asyncio.to_thread(
                self.lobby.handle, identity, msg, tensor_frames, key))
            core, outs = await asyncio.shield(self._creating)  # (a stop: the model is undone)
            self._creating = None
        if core is not None and self._stop.is_set():  # created while stopping: undo
            core.close(final_save=False)
        else:
            self.core = core
        return outs

    async def _decode_large(self, identity: bytes, frames: list):
        """On the decoder thread, once this peer's pace allows (see inbox.py)."""
        if (wait := self._inbox.wait(identity)) > 0:
            await asyncio.sleep(wait)
        return self._inbox.decoded(identity, await asyncio.wrap_future(self._inbox.decode(frames)))

    async def _send(self, outs: list[Out]) -> None:
        """Send without blocking: a peer that does not read its replies loses them, counted
        and logged, instead of holding up everyone else (ROUTER_MANDATORY reports it)."""
        for out in outs:
            if type(out.msg) is Error:
                self.stats.errors[out.msg.code] += 1
            elif type(out.msg) is StatusReply and self.board is not None:  # every box's too
                out = Out(out.peer, dataclasses.replace(out.msg, boxes=self.board.view()))
            try:
                await self.sock.send_multipart([out.peer, *codec.encode(out.msg, out.frames)],
                                               flags=zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as e:
                self.stats.replies_dropped += 1
                if out.peer not in self._dropping:
                    self._dropping.add(out.peer)
                    log.warning("dropping replies to %s: %s (it does not read them, or is "
                                "gone)", out.peer.hex(), e.strerror)

    def _wake(self) -> None:
        """An engine finished a job (engine thread): have the loop poll the core."""
        try:
            self._loop.call_soon_threadsafe(self._schedule_poll)
        except RuntimeError:  # the loop is closed: the server is stopping
            pass

    def _schedule_poll(self) -> None:
        if self.core is not None and (self._poller is None or self._poller.done()):
            self._poller = self._loop.create_task(self._poll())
            self._poller.add_done_callback(_log_failure)

    async def _poll(self) -> None:
        """Send what the engines' finished jobs made due, until none is left (a completion
        that arrives while sending is taken by the next round of this loop)."""
        while self.core is not None:
            outs = self.core.poll()
            if not outs:
                break
            await self._send(outs)
        boxes = self.core.engines.boxes if self.core is not None else None
        if boxes is not None and boxes.lost and not self.box_lost:
            # Its workers were told; every box's EPS exits, so that each launcher restarts
            # its job from its last checkpoint (--max-restarts), or the job ends on every box.
            self.box_lost = boxes.lost
            self._loop.call_later(0.2, self._stop.set)  # let the errors go out
        self._check_exit()

    def _check_exit(self) -> None:
        """--exit-when-done: stop once every worker finished and the last updates and
        checkpoints are in, or SETTLE_TIMEOUT after the last worker finished."""
        core = self.core
        if not self.cfg.exit_when_done or core is None:
            return
        if not core.all_done:  # a rank came back: start over when it is done again
            if self._settle_timer is not None:
                self._settle_timer.cancel()
                self._settle_timer = None
            return
        if self._settle_timer is None:
            log.info("all %d workers are done; exiting once the last updates are in",
                     self.cfg.world_size)
            self._settle_timer = self._loop.call_later(SETTLE_TIMEOUT, self._give_up)
        if core.idle():
            self._settle_timer.cancel()
            self._loop.call_later(0.05, self._stop.set)  # let the last replies go out

    def _give_up(self) -> None:
        log.warning("the last step's updates did not finish within %.0f s", SETTLE_TIMEOUT)
        self._stop.set()


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("sending the engines' replies failed", exc_info=task.exception())


def decode_error(frames: list, e: codec.DecodeError) -> Error:
    """The reply to an undecodable message; another protocol version's Hello (which may not
    decode at all) is told about the version first."""
    hello = memoryview(frames[0]).tobytes() == bytes((Hello.KIND,)) if frames else False
    if hello and e.protocol_version is not None and e.protocol_version != PROTOCOL_VERSION:
        return Error(req_id=e.req_id, code="protocol_version",
                     message=version_text(e.protocol_version), field="protocol_version")
    return Error(req_id=e.req_id, code="bad_message", message=str(e), field=e.field)
