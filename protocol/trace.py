"""Chrome / Perfetto trace events, written by the EPS and the workers alike (``--trace PATH``).

Timestamps are wall-clock microseconds (``time.time_ns``), so the files of one job's processes
can be merged into one timeline (``l2l-launch --trace`` does; ``python -m bench.timeline``
renders a PNG). A disabled tracer costs one attribute check per span.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator


class Tracer:
    def __init__(self, path: str = "", process: str = ""):
        self.path = path
        self.enabled = bool(path)
        self.pid = os.getpid()
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self._named: set[int] = set()
        if self.enabled:
            self._events.append({"ph": "M", "name": "process_name", "pid": self.pid,
                                 "args": {"name": process or f"pid {self.pid}"}})

    @contextlib.contextmanager
    def span(self, name: str, cat: str, **args) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.time_ns()
        try:
            yield
        finally:
            self.complete(name, cat, start, time.time_ns(), **args)

    def complete(self, name: str, cat: str, start_ns: int, end_ns: int, **args) -> None:
        """A finished interval (e.g. measured on another thread)."""
        if not self.enabled:
            return
        tid = threading.get_ident()
        ev = {"ph": "X", "name": name, "cat": cat, "pid": self.pid, "tid": tid,
              "ts": start_ns / 1000, "dur": max(end_ns - start_ns, 0) / 1000}
        if args:
            ev["args"] = args
        with self._lock:
            if tid not in self._named:
                self._named.add(tid)
                self._events.append({"ph": "M", "name": "thread_name", "pid": self.pid,
                                     "tid": tid, "args": {"name": threading.current_thread().name}})
            self._events.append(ev)

    def close(self) -> None:
        if not self.enabled:
            return
        with self._lock:
            events, self._events = self._events, []
        with open(self.path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        self.enabled = False


NULL = Tracer()


def merge(paths: list[str], out: str) -> None:
    """One trace file from several processes' files (missing files are skipped)."""
    events: list[dict] = []
    for p in paths:
        try:
            with open(p) as f:
                events += json.load(f)["traceEvents"]
        except (OSError, ValueError, KeyError):
            continue
    with open(out, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
