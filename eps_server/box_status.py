"""Every box's status on every box of a job over several (``--nodes``): ``l2l-ctl status`` on
any box shows them all.

Each box's EPS publishes a compact summary of itself (its step and versions' range, steps
completed, workers, last checkpoint, whether its cross-box group is lost) as JSON under
``l2l-status/<box>`` in the store the boxes' group was joined with (box 0's TCPStore, or
torchrun's): about once a second, and within LOOK_EVERY of a completed step. It reads the other
boxes' summaries every second (every nodes/64 s beyond 64 boxes). A StatusReply carries them as
last read (``StatusReply.boxes``, protocol/box_info.py): answering one never waits on the store.

All store operations run on one daemon thread, through a clone of the store (a connection of
its own, STORE_TIMEOUT s to wait for a key): a store that does not answer (box 0 stopped, a cut
link: a read then waits on the socket, whatever the timeout) holds up that thread only, and
the other boxes show as ``unknown`` once the last read is STALE s old. A store that fails
(box 0 died: it hosts the store) is not used again: the other boxes stay ``unknown``, with the
values last read. A box whose summary has not changed for STALE s is ``stale``; one never read
is ``missing``. Ages are measured here, from when a box's summary was seen to change (its
publication counter): the boxes' clocks need not agree. Once every local worker is done, a
box says so and leaves the store alone (box 0's EPS may be gone already: the job is ending);
box 0, done, lingers a moment for the others to get there (``close``).
"""

from __future__ import annotations

import datetime
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

from protocol.box_info import BoxInfo

from .config import ServerConfig
from .stats import EpsStats

log = logging.getLogger("eps_server")

PREFIX = "l2l-status"  # PrefixStore adds the "/": keys l2l-status/<box>
PUBLISH_EVERY = 1.0  # seconds between publications when no step completes
LOOK_EVERY = 0.1  # the thread looks for a completed step this often (<= 10 publications/s)
STALE = 5.0  # a summary unchanged this long is stale; a last read this old: boxes unknown
STORE_TIMEOUT = 2.0
LINGER = 3.0  # box 0 at its end waits this long at most for the other boxes to finish theirs
HOST = socket.gethostname()
SUMMARY = tuple(f.name for f in fields(BoxInfo) if f.name not in ("state", "age"))


def status_store(prefix: str = PREFIX):
    """The boxes' store (after the group was joined), as a connection of this thread's own."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    try:
        store = store.clone()  # its own socket: never shared with gloo's, its own timeout
    except (NotImplementedError, RuntimeError):  # a store that cannot be cloned: shared
        pass
    else:
        store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT))
    return dist.PrefixStore(prefix, store)


def summarize(cfg: ServerConfig, stats: EpsStats, core) -> dict:
    """This box's summary, from the core (or the lobby's nothing); safe off the loop (reads
    only: a list's min and max, the peers' snapshot, counters)."""
    versions = core.store.versions if core is not None else ()
    workers = [p for p in core.peers.snapshot() if p.worker] if core is not None else []
    now = core.peers.clock() if core is not None else 0.0
    boxes = core.engines.boxes if core is not None else None
    return {"box": cfg.boxes.node_rank, "host": HOST,
            "step": int(max(0, min(versions, default=0))),
            "newest": int(max(0, max(versions, default=0))),
            "steps_completed": int(stats.steps_completed), "workers": len(workers),
            "alive": sum(now - p.last_seen <= cfg.heartbeat_timeout / 2 for p in workers),
            "world_size": cfg.world_size, "last_checkpoint": int(stats.last_checkpoint_step),
            "lost": bool(getattr(boxes, "lost", None))}


def info(summary: dict, state: str, age: float) -> BoxInfo:
    """A summary as StatusReply shows it; ValueError or TypeError if it is not one."""
    if not isinstance(summary, dict) or not all(k in summary for k in SUMMARY):
        raise ValueError("not a box summary")
    box = BoxInfo(state=state, age=round(age, 3), **{k: summary[k] for k in SUMMARY})
    for f in fields(BoxInfo):  # the store is the boxes' own, but a reply must encode
        want = float if f.type == "float" else {"int": int, "str": str, "bool": bool}[f.type]
        if type(getattr(box, f.name)) is not want:
            raise TypeError(f"{f.name}: not a {f.type}")
    return box


@dataclass
class Seen:
    summary: dict
    seq: int
    at: float  # when it was seen to change (this box's clock)


class BoxBoard:
    """This box's summary in the boxes' store, and every box's as last read (``view``)."""

    def __init__(self, cfg: ServerConfig, stats: EpsStats, core: Callable[[], object],
                 store=None, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.stats, self._core, self._clock = cfg, stats, core, clock
        self.box, self.nodes = cfg.boxes.node_rank, cfg.boxes.nodes
        self.read_every = max(PUBLISH_EVERY, self.nodes / 64)
        self.stale = max(STALE, 3 * self.read_every)
        self.failed = ""  # why the store is not used any more
        self.published = 0  # summaries written
        self._store = store  # None: status_store(), made on the thread
        self._seen: dict[int, Seen] = {}
        self._bad: set[int] = set()  # boxes whose summary did not read (said once)
        self._read_at: float | None = None  # the last complete read of the others
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eps-box-status", daemon=True)
        self._thread.start()

    def view(self) -> tuple[BoxInfo, ...]:
        """Every box, this one as it is now; never waits on the store."""
        now = self._clock()
        with self._lock:
            seen, read_at, failed = dict(self._seen), self._read_at, self.failed
        readable = not failed and read_at is not None and now - read_at <= self.stale
        out = []
        for b in range(self.nodes):
            s = seen.get(b)
            if b == self.box:
                out.append(info(summarize(self.cfg, self.stats, self._core()), "ok", 0.0))
            elif s is None:
                out.append(BoxInfo(box=b, state="missing" if readable else "unknown"))
            else:
                age = now - s.at
                out.append(info(s.summary, "unknown" if not readable else
                                "stale" if age > self.stale else "ok", age))
        return tuple(out)

    def close(self, core=None) -> None:
        """Stop the thread (one stuck in a store operation is left behind: a daemon). Box 0,
        whose store goes with it, first lingers (LINGER s at most) once its own workers are
        done, until every other box's are too (then that box leaves the store alone) or that
        box is not ok: the store failing under a box finishing its job would log a scare."""
        if self.box == 0 and core is not None and core.all_done and self._thread.is_alive():
            self.read_every = LOOK_EVERY
            deadline = self._clock() + LINGER
            while self._clock() < deadline and not all(
                    b.state != "ok" or self._seen[b.box].summary.get("done")
                    for b in self.view()[1:]):
                time.sleep(LOOK_EVERY / 2)
        self._stop.set()
        self._thread.join(0.5)

    def _run(self) -> None:
        steps, published, read, said, core = -1, float("-inf"), float("-inf"), False, None
        try:
            store = self._store if self._store is not None else status_store()
            while not self._stop.wait(LOOK_EVERY):
                if (now_core := self._core()) is not None:
                    core = now_core  # else the last one: the server lets go of it as it stops
                finished = core is not None and core.all_done and self.box != 0
                if finished and said:  # the job ends here: box 0 may be gone at any time
                    continue
                now, done = self._clock(), self.stats.steps_completed
                if done != steps or now - published >= PUBLISH_EVERY or finished:
                    steps, published, said = done, now, finished
                    self.published += 1
                    body = {**summarize(self.cfg, self.stats, core), "seq": self.published,
                            "time": time.time(), "done": core is not None and core.all_done}
                    store.set(str(self.box), json.dumps(body).encode())
                if now - read >= self.read_every and not finished:
                    self._read(store)
                    read = now
        except Exception as e:  # the store is gone (box 0 died) or broken: not used again
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            with self._lock:
                self.failed = why
            if not self._stop.is_set():
                log.info("box status: the boxes' store failed (box 0 is gone?): %s; the other "
                         "boxes show as unknown from now on", why)

    def _read(self, store) -> None:
        """Read every other box's summary that is there (one round trip, plus one per box
        never seen yet)."""
        others = [b for b in range(self.nodes) if b != self.box]
        there = [b for b in others if b in self._seen or store.check([str(b)])]
        raws = store.multi_get([str(b) for b in there]) if there else []
        now = self._clock()
        with self._lock:
            for b, raw in zip(there, raws):
                try:
                    summary = json.loads(bytes(raw))
                    info(summary, "ok", 0.0)  # a reply can carry it
                    seq = summary["seq"]
                except (ValueError, TypeError, KeyError):  # said once: it is read every second
                    if b not in self._bad:
                        self._bad.add(b)
                        log.warning("box status: box %d's summary in the store is not one", b)
                    continue
                old = self._seen.get(b)
                if old is None or old.seq != seq:
                    self._seen[b] = Seen(summary, seq, now)
            self._read_at = now

