"""Typed events from eps-server and l2l-worker to whoever started them (l2l-launch, tests).

A process started with ``--events TARGET`` writes one JSON object per line to TARGET: a file
path, or ``fd:N``, a pipe whose write end the parent passed down (l2l-launch does). Each line is
``{"event": KIND, ...fields}``; ``decode`` rebuilds the typed event and refuses anything else.
Logs stay logs: nothing here is parsed out of stdout or stderr.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from dataclasses import dataclass
from typing import ClassVar

EVENTS: dict[str, type] = {}


def event(kind: str):
    def wrap(cls):
        cls = dataclass(frozen=True, kw_only=True)(cls)
        cls.KIND = kind
        EVENTS[kind] = cls
        return cls

    return wrap


@event("ready")
class Ready:
    """The EPS accepts workers; ``step``: the step it serves from (0 for a new model, else
    the checkpoint's it resumed from)."""

    KIND: ClassVar[str]
    endpoint: str
    run_id: str
    pid: int
    step: int = 0


@event("starting")
class Starting:
    """The EPS is still starting and alive: ``phase`` "joining" the boxes (it waits up to
    ``patience`` seconds for them), "checking" a checkpoint (said before and after each file)
    or "loading" it (``done`` of ``total`` layers).
    Whoever waits for Ready counts its patience from the latest of these, so a long start that
    shows progress is not taken for a hung one."""

    KIND: ClassVar[str]
    phase: str
    done: int = 0
    total: int = 0
    patience: float = 0.0


@event("joined")
class Joined:
    """A worker joined the job (``rejoined``: it replaces a dead worker of its rank) and runs
    step ``step`` next, whose gradients of ``pushed`` layers the EPS already has."""

    KIND: ClassVar[str]
    rank: int
    pid: int
    step: int
    pushed: int
    rejoined: bool


@event("step")
class StepDone:
    """A worker finished a step. ``loss`` is this worker's share of the global mean loss
    (shares add up across workers); ``count`` its loss terms (samples or tokens)."""

    KIND: ClassVar[str]
    rank: int
    step: int
    loss: float
    correct: int
    count: int
    samples: int
    seconds: float
    fetch_wait: float = 0.0  # seconds of the step blocked waiting for weights
    push_wait: float = 0.0  # seconds blocked on gradient slots and push acks


@event("eval")
class EvalDone:
    """A worker evaluated its share of the eval data with the weights of ``step`` (steps
    trained): summed loss, correct predictions and loss terms (samples or tokens)."""

    KIND: ClassVar[str]
    rank: int
    step: int
    loss_sum: float
    correct: int
    count: int
    objective: str  # "classify" (report accuracy) or "lm" (report perplexity)


@event("peer_lost")
class PeerLost:
    """The EPS declared a worker dead (``silent`` seconds without a message): its rank is free
    for a replacement. ``exited``: the EPS saw its process gone (or exiting), else it is hung,
    still running, and whoever started it should stop it."""

    KIND: ClassVar[str]
    rank: int
    pid: int
    silent: float
    exited: bool = False


@event("checkpoint_failed")
class CheckpointFailed:
    """A checkpoint of step ``step`` to ``path`` could not be written (``error``, one line);
    the latest good one there is of step ``last_step`` (-1: none). ``final``: the one written
    as the EPS exits. Its partial files are removed; the next checkpoint is tried again."""

    KIND: ClassVar[str]
    step: int
    path: str
    error: str
    last_step: int
    final: bool = False


@event("stats")
class ServerStats:
    """The EPS's statistics (its EpsStats snapshot), sent when it stops."""

    KIND: ClassVar[str]
    stats: dict


def encode(ev) -> str:
    return json.dumps({"event": ev.KIND, **dataclasses.asdict(ev)})


def decode(line: str):
    """The typed event of one line; ValueError for anything malformed."""
    obj = json.loads(line)
    if not isinstance(obj, dict) or obj.get("event") not in EVENTS:
        raise ValueError(f"not an event: {line[:80]!r}")
    cls = EVENTS[obj.pop("event")]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    needed = {n for n, f in fields.items() if f.default is dataclasses.MISSING}
    if not needed <= set(obj) <= set(fields):  # (a field with a default may be left out)
        raise ValueError(f"{cls.KIND} event with fields {sorted(obj)}, expected {sorted(fields)}")
    for name, value in obj.items():
        kind = fields[name].type
        want = {"int": int, "float": (int, float), "str": str, "dict": dict, "bool": bool}[kind]
        if not isinstance(value, want) or (isinstance(value, bool) and kind != "bool"):
            raise ValueError(f"{cls.KIND}.{name}: expected {kind}")
    return cls(**obj)


class EventWriter:
    """Writes events to ``target`` ("" writes nothing). Safe to call from any thread."""

    def __init__(self, target: str = ""):
        self._lock = threading.Lock()
        self._file = None
        if target.startswith("fd:"):
            self._file = os.fdopen(int(target[3:]), "w", buffering=1)
        elif target:
            self._file = open(target, "a", buffering=1)

    def emit(self, ev) -> None:
        if self._file is None:
            return
        with self._lock:
            try:
                self._file.write(encode(ev) + "\n")
            except (OSError, ValueError):  # the reader went away: events are best effort
                self._file = None

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                try:
                    self._file.close()
                except OSError:
                    pass
                self._file = None


def read_events(path: str) -> list:
    """Every well-formed event in a file (tests, tools)."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(decode(line))
                except ValueError:
                    pass
    except FileNotFoundError:
        pass
    return out



def wait_for(path: str, kind: type, proc=None, timeout: float = 60.0):
    """The first event of type ``kind`` in the file ``path``, waiting up to ``timeout`` s;
    RuntimeError if ``proc`` (a Popen) exits first."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        for ev in read_events(path):
            if isinstance(ev, kind):
                return ev
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with status {proc.returncode} before "
                               f"{kind.KIND}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {kind.KIND} event in {path} within {timeout:.0f} s")
        time.sleep(0.05)
