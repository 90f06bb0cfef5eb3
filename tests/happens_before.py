"""A happens-before check of CUDA stream discipline, run on the CPU with fake streams.

Agents are the CUDA streams (by name) and the host threads. Each has a vector clock:
- every aten op (seen by a TorchDispatchMode in each thread that issues work) runs on the
  stream current in its thread; a stream first learns what the issuing thread knows (work
  issued after a host synchronization runs after what was synchronized on);
- an event carries its stream's clock when recorded; a stream waiting on it merges it, and so
  does a host thread synchronizing on it (``query`` teaches nothing: a real query may say no);
- a thread handing work to another (a pool's submit, a message, a slot given back) passes its
  clock with it.
Two accesses to a watched buffer by different agents, one of them a write, must be ordered,
or it is a race the GPU could lose. ``dropped`` = (waiting agent, event's stream) skips such
waits ("host" for synchronizations), to show that the check sees a missing one.

Limits: it checks the one run it watches (copies are done when issued, so the order in which
the host learns of things is one the GPU may not repeat: edges that only this order gives can
hide a missing wait); side streams are named by role (h2d, d2h, stash), so one run clocks one
Streams per role; the caching allocator is not modelled (what new memory was before).
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import test_stash

HOST = "host"


def span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


class HappensBefore:
    def __init__(self, dropped: tuple[str, str] | None = None):
        self.lock = threading.RLock()
        self.clocks: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.local = threading.local()  # .agent: the stream work goes to (or HOST)
        self.buffers: list[tuple[int, int, str]] = []  # (start, end, name)
        self.accesses: dict[int, list] = {}  # buffer -> [(agent, clock, write, op)]
        self.races: list[tuple] = []
        self.dropped = dropped

    def host(self) -> str:
        thread = threading.current_thread()
        return f"{HOST} {thread.name} {thread.ident}"

    def agent(self) -> str:
        agent = getattr(self.local, "agent", None) or "compute"
        return self.host() if agent == HOST else agent

    def stream(self) -> str:
        """The thread's current stream (CUDA's default for events and waits)."""
        agent = getattr(self.local, "agent", None)
        return agent if agent not in (None, HOST) else "compute"

    @contextlib.contextmanager
    def on(self, stream: str):
        """Work of this thread goes to ``stream`` (HOST: runs on the host, at once)."""
        before, self.local.agent = getattr(self.local, "agent", None), stream
        try:
            yield
        finally:
            self.local.agent = before

    def watch(self, t: torch.Tensor, name: str) -> None:
        with self.lock:
            if (*span(t), name) not in self.buffers:
                self.buffers.append((*span(t), name))

    def _issued(self, agent: str) -> dict[str, int]:
        """``agent``'s clock, a stream's after learning what the issuing thread knows."""
        clock = self.clocks[agent]
        if not agent.startswith(HOST):
            _merge(clock, self.clocks[self.host()])
        return clock

    def op(self, touched: list[tuple[torch.Tensor, bool]], op: str) -> None:
        """One op of the current agent reading (or writing: True) each tensor."""
        with self.lock:
            me = self.agent()
            self.op_as(me, self._issued(me), touched, op)

    def op_as(self, me: str, clock: dict[str, int], touched, op: str) -> None:
        """One op of agent ``me``, whose clock is ``clock`` (ticked)."""
        with self.lock:
            clock[me] = clock.get(me, 0) + 1
            now = dict(clock)
            for t, write in touched:
                if isinstance(t, torch.Tensor) and t.numel():
                    self._touch(t, write, op, me, now)

    def _touch(self, t, write: bool, op: str, me: str, now: dict) -> None:
        lo, hi = span(t)
        for k, (a, b, name) in enumerate(self.buffers):
            if lo < b and a < hi:
                for other, then, wrote, what in self.accesses.setdefault(k, []):
                    if other != me and (wrote or write) and now.get(other, 0) < then[other]:
                        self.races.append((name, other, what, me, op))
                self.accesses[k].append((me, now, write, op))

    def record(self, stream: str) -> dict[str, int]:
        with self.lock:
            return dict(self._issued(stream))

    def wait(self, stream: str, event: Event) -> None:
        if (stream, event.stream) != self.dropped:
            with self.lock:
                _merge(self._issued(stream), event.clock)

    def synchronize(self, event: Event) -> None:
        if (HOST, event.stream) != self.dropped:
            self.receive(event.clock)

    def send(self) -> dict[str, int]:
        """What this thread knows, to hand to another with work or a message."""
        with self.lock:
            return dict(self.clocks[self.host()])

    def receive(self, clock: dict[str, int] | None) -> None:
        if clock:
            with self.lock:
                _merge(self.clocks[self.host()], clock)

    @contextlib.contextmanager
    def knowing(self, clock: dict[str, int] | None):
        """This thread knows ``clock`` too, for the time being (a callback run for one reply,
        in a thread that serves many)."""
        with self.lock:
            before = dict(self.clocks[self.host()])
        self.receive(clock)
        try:
            yield
        finally:
            with self.lock:
                mine = self.clocks[self.host()]
                mine.clear()
                mine.update(before)

    def seen(self) -> set[str]:
        """The agents that touched a watched buffer."""
        return {agent for accesses in self.accesses.values() for agent, *_ in accesses}


def _merge(into: dict[str, int], clock: dict[str, int]) -> None:
    for agent, n in clock.items():
        if n > into[agent]:
            into[agent] = n


def joined(*clocks: dict[str, int]) -> dict[str, int]:
    """What knowing all of ``clocks`` knows."""
    out: dict[str, int] = defaultdict(int)
    for clock in clocks:
        _merge(out, clock)
    return dict(out)


class Event(test_stash.Event):
    def __init__(self, hb: HappensBefore, stream: str):
        super().__init__(stream)
        self.hb, self.clock = hb, hb.record(stream)

    def synchronize(self) -> None:
        self.hb.synchronize(self)


class Ops(TorchDispatchMode):
    """Each aten op (but views): one op of the current agent on its tensor arguments, written
    where the schema says the op writes them."""

    def __init__(self, hb: HappensBefore):
        super().__init__()
        self.hb = hb

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not func.is_view:
            schema = func._schema.arguments
            given = list(args) + [kwargs.get(a.name) for a in schema[len(args):]]
            touched = []
            for arg, value in zip(schema, given):
                write = arg.alias_info is not None and arg.alias_info.is_write
                touched += [(t, write) for t in
                            (value if isinstance(value, (list, tuple)) else [value])]
            self.hb.op(touched, str(func))
        return func(*args, **kwargs)


class ClockedPool(ThreadPoolExecutor):
    """A helper thread whose ops are seen, and which learns what its submitter knew."""

    def __init__(self, hb: HappensBefore, name: str):
        super().__init__(1, name, initializer=lambda: Ops(hb).__enter__())
        self.hb = hb

    def submit(self, fn, /, *args, **kwargs):
        clock = self.hb.send()

        def run():
            self.hb.receive(clock)
            return fn(*args, **kwargs)

        return super().submit(run)


class ClockedStreams(test_stash.LoggedStreams):
    """Events carry clocks, waits merge them; work runs on the stream ``on`` names, in the
    calling thread; helper threads are clocked too."""

    def __init__(self, hb: HappensBefore):
        super().__init__()
        self.hb = hb

    def event(self, stream=None, host_waits=False):
        return Event(self.hb, stream or self.hb.stream())

    def wait(self, event, stream=None):
        if event is not None:
            self.hb.wait(stream or self.hb.stream(), event)

    def on(self, stream):
        return self.hb.on(stream)

    def pinned(self, shape, dtype):
        t = torch.empty(shape, dtype=dtype)
        self.hb.watch(t, "host slot")
        return t

    def thread_pool(self, name: str) -> ThreadPoolExecutor:
        return ClockedPool(self.hb, name)
