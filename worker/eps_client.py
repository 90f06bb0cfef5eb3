"""Typed client of the EPS: hello, init_layer, fetch, push_grad, save, status, bye.

One I/O thread owns the ZeroMQ DEALER socket; any thread may call. Every call returns a
``concurrent.futures.Future`` resolved with the reply (or an ``EpsError``), so the executor can
have fetches and pushes in flight while it computes. A socket monitor notices the server
going away, or refusing this client's CURVE handshake: every pending call then fails with
``EpsDisconnected`` instead of hanging.

Once joined, the I/O thread sends a Heartbeat every ``heartbeat_interval`` (Welcome) while the
worker makes progress (a request or ``tick()`` within ``stall_timeout``, or waiting for a reply
the EPS owes it): a worker whose loop is stuck (a deadlock, a hung device) falls silent and the
EPS declares it dead. If the EPS answers a heartbeat with "not_registered", this worker was
declared dead: every call fails.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import queue
import socket
import threading
import time
from concurrent.futures import Future

import zmq
from zmq.utils.monitor import recv_monitor_message

from protocol import codec
from protocol.curve import HANDSHAKE_FAILED, ClientKeys, handshake_failure
from protocol.endpoints import check_connect, ipv6
from protocol.lifecycle import process_identity
from protocol.messages import (
    PROTOCOL_VERSION,
    Ack,
    Bye,
    Error,
    Fetch,
    Heartbeat,
    Hello,
    InitLayer,
    Message,
    PushGrad,
    Save,
    Status,
    StatusReply,
    Welcome,
)
from protocol.tensors import Manifest

log = logging.getLogger(__name__)
# Heartbeats go at least this often (more often than the EPS asks when its timeout is long):
# they carry this worker's report, which status and metrics show.
REPORT_EVERY = 1.0


class EpsError(RuntimeError):
    """The EPS answered with an Error."""

    def __init__(self, code: str, message: str, field: str = ""):
        super().__init__(f"EPS refused the request ({code}"
                         f"{', field ' + field if field else ''}): {message}")
        self.code, self.field, self.detail = code, field, message


class EpsDisconnected(ConnectionError):
    """The connection to the EPS was lost (the server exited or was killed)."""


class EpsClient:
    def __init__(self, endpoint: str, timeout: float = 600.0, curve: ClientKeys | None = None):
        self._connect_now = check_connect(endpoint)  # (False: once its folder is there)
        self.endpoint = endpoint
        self.timeout = timeout
        self._curve = curve
        self._ctx = zmq.Context()
        self._ids = itertools.count(1)
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._closed = False
        self._lost: str | None = None
        self._beat_every = 0.0  # seconds; 0: no heartbeats (not joined yet)
        self._report = None  # the latest WorkerReport, sent with the next heartbeat
        self._stall_timeout = 0.0
        self._next_beat = 0.0
        self._progress = time.monotonic()
        self._stalled = False
        self._loop = None  # the thread of the worker's loop (start_heartbeats' caller)
        self._loop_waits = 0  # > 0 while that thread is blocked in wait(): the EPS owes it
        self._thread = threading.Thread(target=self._run, name="eps-client", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------- calls

    def request(self, msg_type: type[Message], frames=(), **fields) -> Future:
        """Send a request (req_id is filled in); the future resolves to (reply, frames)."""
        fut: Future = Future()
        req_id = next(self._ids)
        msg = msg_type(req_id=req_id, **fields)
        wire = codec.encode(msg, frames)
        self._progress = time.monotonic()
        with self._lock:
            if self._lost is not None or self._closed:
                fut.set_exception(EpsDisconnected(self._lost or "client closed"))
                return fut
            self._pending[req_id] = fut
        self._outbox.put(wire)
        self._wake_w.send(b"\0")
        return fut

    def call(self, msg_type: type[Message], frames=(), **fields):
        """Blocking request; returns the reply message (raises EpsError on an Error reply)."""
        fut = self.request(msg_type, frames, **fields)
        return self.wait(fut)[0]

    def wait(self, fut: Future, timeout: float | None = None):
        loop = threading.get_ident() == self._loop
        if loop:  # only the loop's thread writes the count
            self._loop_waits += 1
        try:
            return fut.result(timeout if timeout is not None else self.timeout)
        except TimeoutError:
            raise TimeoutError(f"no reply from the EPS at {self.endpoint} within "
                               f"{timeout or self.timeout:.0f} s") from None
        finally:
            if loop:
                self._loop_waits -= 1
                self._progress = time.monotonic()

    def hello(self, *, rank: int, world_size: int, manifest: Manifest, transport: str,
              grad_dtype: str, send_manifest: bool = True, timeout: float | None = None,
              protocol_version: int = PROTOCOL_VERSION, samples_per_step: int = 0) -> Welcome:
        fut = self.request(Hello, protocol_version=protocol_version, rank=rank,
                           world_size=world_size, manifest_hash=manifest.hash(),
                           manifest=manifest if send_manifest else None, transport=transport,
                           grad_dtype=grad_dtype, pid=os.getpid(), host=socket.gethostname(),
                           process=process_identity(), samples_per_step=samples_per_step)
        return self.wait(fut, timeout)[0]

    def observe(self, timeout: float | None = None) -> None:
        """Join as an observer (a control client): no rank, nobody evicted."""
        self.wait(self.request(Hello, protocol_version=PROTOCOL_VERSION, role="observer",
                               pid=os.getpid(), host=socket.gethostname()), timeout)

    def start_heartbeats(self, interval: float, stall_timeout: float = 0.0) -> None:
        """Send a Heartbeat every ``interval`` s while the calling thread (the worker's loop)
        makes progress: a request or ``tick()`` within ``stall_timeout`` s (0: always), or it
        is blocked in ``wait()`` (the EPS owes it a reply; it never waits for what only it can
        cause, so that is not a hang of its own)."""
        self._loop = threading.get_ident()
        self._stall_timeout = stall_timeout
        interval = min(interval, REPORT_EVERY)
        self._next_beat = time.monotonic() + interval
        self._beat_every = interval
        self._wake_w.send(b"\0")

    def report(self, report) -> None:
        """Send this WorkerReport with the next heartbeats (the EPS's status and metrics show
        it); one reference swap, nothing sent from the calling thread."""
        self._report = report

    def tick(self) -> None:
        """The worker's loop made progress (see start_heartbeats)."""
        self._progress = time.monotonic()

    def init_layer(self, layer: int, data, frozen_dtype: str = "float32") -> Future:
        return self.request(InitLayer, frames=(data,), layer=layer, frozen_dtype=frozen_dtype)

    def fetch(self, layer: int, min_version: int, which: str = "compute") -> Future:
        return self.request(Fetch, layer=layer, min_version=min_version, which=which)

    def push_grad(self, *, step: int, layer: int, rank: int, slot: int, dtype: str,
                  data=None, skip: bool = False) -> Future:
        return self.request(PushGrad, frames=(data,) if data is not None else (), step=step,
                            layer=layer, rank=rank, slot=slot, dtype=dtype, skip=skip)

    def save(self, path: str) -> Ack:
        return self.call(Save, path=path)

    def status(self, timeout: float | None = None) -> StatusReply:
        return self.wait(self.request(Status), timeout)[0]

    def bye(self, rank: int, done: bool) -> None:
        try:
            self.wait(self.request(Bye, rank=rank, done=done), timeout=10.0)
        except (EpsError, EpsDisconnected, TimeoutError) as e:
            log.warning("bye not acknowledged: %s", e)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake_w.send(b"\0")
        self._thread.join(timeout=5.0)
        self._fail_all(EpsDisconnected("client closed"))
        self._wake_r.close()
        self._wake_w.close()
        self._ctx.term()

    # ------------------------------------------------------------------------- I/O thread

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.setsockopt(zmq.IPV6, ipv6(self.endpoint))
        if self._curve is not None:
            self._curve.apply(sock)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
                                          | HANDSHAKE_FAILED)
        if self._connect_now:
            sock.connect(self.endpoint)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        # Sends never block (a DEALER with no connected peer would, forever): what the socket
        # does not take waits here, and the poller says when it can take more.
        backlog: collections.deque = collections.deque()
        try:
            while not self._closed:
                wait = None if self._connect_now else 100
                if not self._connect_now:
                    try:
                        ready = check_connect(self.endpoint)
                    except ValueError as e:  # its folder, made meanwhile, is not ours alone
                        self._on_lost(str(e))
                        return
                    if ready:
                        sock.connect(self.endpoint)
                        self._connect_now = True
                if self._beat_every:
                    now = time.monotonic()
                    if now >= self._next_beat:
                        self._beat(backlog, now)
                        self._flush(sock, backlog)
                    wait = max(1, int(1000 * (self._next_beat - now)))
                for item, events in poller.poll(wait):
                    if item is sock:
                        if events & zmq.POLLIN:
                            self._on_reply(sock.recv_multipart(copy=False))
                    elif item is monitor:
                        event = recv_monitor_message(monitor)["event"]
                        if event & HANDSHAKE_FAILED:  # before the disconnection it causes
                            self._on_lost(f"{self.endpoint}: " + handshake_failure(
                                event, self._curve is not None))
                        elif event == zmq.EVENT_DISCONNECTED:
                            self._on_lost("the EPS closed the connection (server exited?)")
                    else:
                        try:
                            self._wake_r.recv(4096)
                        except BlockingIOError:
                            pass
                        while True:
                            try:
                                backlog.append(self._outbox.get_nowait())
                            except queue.Empty:
                                break
                self._flush(sock, backlog)
                poller.modify(sock, zmq.POLLIN | (zmq.POLLOUT if backlog else 0))
        except Exception as e:  # a broken socket: fail every caller rather than hang them
            log.exception("EPS client I/O thread failed")
            self._on_lost(f"client I/O failed: {e}")
        finally:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            monitor.close(0)
            # Lost: nothing queued can be delivered (and lingering on a connection whose
            # handshake keeps failing can hold up the context's termination).
            sock.close(0 if self._lost else None)

    @staticmethod
    def _flush(sock, backlog) -> None:
        while backlog:
            try:
                sock.send_multipart(backlog[0], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            backlog.popleft()

    def _beat(self, backlog, now: float) -> None:
        self._next_beat = now + self._beat_every
        if self._loop_waits:  # the loop waits for the EPS (e.g. a version not there yet)
            self._progress = now
        if self._stall_timeout and now - self._progress > self._stall_timeout:
            if not self._stalled:
                self._stalled = True
                log.error("no progress for %.0f s: heartbeats stopped, the EPS will declare "
                          "this worker dead", now - self._progress)
            return
        if backlog:
            return  # the connection is not taking messages: the queued ones go first
        fut: Future = Future()
        req_id = next(self._ids)
        with self._lock:
            self._pending[req_id] = fut
        fut.add_done_callback(self._beat_answered)
        backlog.append(codec.encode(Heartbeat(req_id=req_id, report=self._report)))

    def _beat_answered(self, fut: Future) -> None:
        e = fut.exception()
        if isinstance(e, EpsError) and e.code == "not_registered":
            self._on_lost("the EPS no longer knows this worker: it was declared dead (silent "
                          "for longer than the EPS's heartbeat timeout)")

    def _on_reply(self, frames) -> None:
        try:
            msg, tensor_frames = codec.decode(frames)
        except codec.DecodeError as e:
            log.error("undecodable reply from the EPS: %s", e)
            return
        with self._lock:
            fut = self._pending.pop(msg.req_id, None)
        if fut is None:
            log.warning("reply to unknown request %d (%s)", msg.req_id, type(msg).__name__)
            return
        if isinstance(msg, Error):
            fut.set_exception(EpsError(msg.code, msg.message, msg.field))
        else:
            fut.set_result((msg, tensor_frames))  # the memoryviews keep their zmq frames alive

    def _on_lost(self, why: str) -> None:
        with self._lock:
            self._lost = self._lost or why  # the first cause (a disconnection follows others)
            why = self._lost
        self._fail_all(EpsDisconnected(why))

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(exc)

