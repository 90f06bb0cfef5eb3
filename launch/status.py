"""``l2l-ctl status`` as tables (rich): the job, its workers, its layers; ``watch`` redraws them
(each redraw is one Status request, answered by the EPS from its bookkeeping).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import time

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

MAX_LAYER_ROWS = 24  # the rest are summarised in one line


def as_json(r) -> dict:
    """A StatusReply as plain JSON values (--json)."""
    return {"run_id": r.run_id, "step": r.step, "world_size": r.world_size,
            "ranks": list(r.ranks), "versions": list(r.versions), "stats": r.stats,
            "workers": [dataclasses.asdict(w) for w in r.workers],
            "updated_ms": list(r.updated_ms),
            "boxes": [dataclasses.asdict(b) for b in getattr(r, "boxes", ())]}


def render(r) -> Group:
    s = r.stats
    head = Table.grid(padding=(0, 2))
    mem = s.get("vmrss_bytes", 0) / 2**20
    shm = s.get("rssshmem_bytes", 0) / 2**20
    head.add_row(f"run [bold]{escape(r.run_id)}[/]", f"step [bold]{r.step}[/]",
                 f"workers {len(r.ranks)}/{r.world_size}",
                 f"lr {s.get('lr_now', s.get('lr', 0)):.3g}",
                 f"loss scale {s.get('loss_scale', 1):g}",
                 f"EPS memory {mem:,.0f} MiB ({shm:,.0f} MiB shared)",
                 f"pushes {s.get('pushes', 0):,}", f"errors: {s.get('bad_messages', 0)} "
                 f"undecodable, {s.get('busy_refusals', 0)} busy", checkpoints(s))
    workers = Table(title="workers (from their heartbeats: samples/s over each one's steps so "
                          "far, the other figures of its last step)", title_justify="left")
    for col in ("rank", "host", "pid", "step", "samples/s", "loss", "step time",
                "waiting fetch / push", "memory (peak)", "last seen"):
        workers.add_column(col, justify="left" if col == "host" else "right")
    for w in r.workers:
        p = w.report
        figures = ("-",) * 5 if p is None else (
            f"{p.samples_per_sec:,.1f}", f"{p.loss:.4f}", f"{p.step_seconds:.3f} s",
            f"{p.fetch_wait:.3f} / {p.push_wait:.3f} s",
            f"{p.memory / 2**20:,.0f} ({p.peak_memory / 2**20:,.0f}) MiB")
        workers.add_row(str(w.rank), Text(w.host), str(w.pid), str(w.step), *figures,
                        f"{w.silent:.1f} s ago")  # (a host is a peer's words: no markup)
    layers = Table(title="layers", title_justify="left")
    for col in ("layer", "version", "last update"):
        layers.add_column(col, justify="right")
    shown = list(enumerate(zip(r.versions, r.updated_ms or [-1] * len(r.versions))))
    for i, (v, ms) in shown[:MAX_LAYER_ROWS]:
        layers.add_row(str(i), str(v), "-" if ms < 0 else f"{ms / 1000:.1f} s ago")
    if len(shown) > MAX_LAYER_ROWS:
        rest = [v for _, (v, _) in shown[MAX_LAYER_ROWS:]]
        layers.add_row(f"{MAX_LAYER_ROWS}..{len(shown) - 1}", f"{min(rest)}..{max(rest)}", "")
    boxes = getattr(r, "boxes", ())
    return Group(head, *([box_table(boxes)] if len(boxes) > 1 else []), workers, layers)


STATES = {"ok": "green", "stale": "yellow", "missing": "yellow", "unknown": "red"}


def box_table(boxes) -> Table:
    """One line per box of a job over several (each as its EPS last published itself); the
    rest of the page is this box's."""
    t = Table(title="boxes (as each published itself; the workers and layers below are this "
                    "box's)", title_justify="left")
    for col in ("box", "host", "state", "step", "versions", "steps done", "workers alive / "
                "connected / all", "last checkpoint", "group", "published"):
        t.add_column(col, justify="left" if col in ("host", "state", "group") else "right")
    for b in boxes:
        known = b.age >= 0
        row = ((Text(b.host), str(b.step), f"{b.step}..{b.newest}", str(b.steps_completed),
                f"{b.alive} / {b.workers} / {b.world_size}",
                "-" if b.last_checkpoint < 0 else str(b.last_checkpoint),
                "[bold red]lost[/]" if b.lost else "ok")
               if known else ("",) + ("-",) * 5 + ("",))
        t.add_row(str(b.box), row[0], f"[{STATES[b.state]}]{b.state}[/]", *row[1:],
                  f"{b.age:.1f} s ago" if known else "-")
    return t


def checkpoints(s: dict) -> str:
    """Checkpoints written and failed (a full disk), red while the last ones fail."""
    text = (f"checkpoints {s.get('checkpoints_written', 0)} written, last step "
            f"{s.get('last_checkpoint_step', -1)}")
    failed = s.get("checkpoint_failures", 0)
    return f"{text}, [bold red]{failed} failed[/]" if failed else text


def show(renderable) -> None:
    console = Console()
    if not console.is_terminal:  # a pipe or file: no width to fit, so wrap nothing
        console = Console(width=200)
    console.print(renderable)


def watch(client, interval: float, json_lines: bool) -> None:
    """Redraw every ``interval`` s until Ctrl-C (``json_lines``: one JSON line per poll)."""
    redraw = not json_lines and sys.stdout.isatty()  # else (a file, a pipe): one table a poll
    # Ctrl-C ends it even where it was started with SIGINT ignored (a script's background job)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with Live(auto_refresh=False) if redraw else contextlib.nullcontext() as live:
            while True:
                r = client.status()
                if json_lines:
                    print(json.dumps(as_json(r)), flush=True)
                elif redraw:
                    live.update(render(r), refresh=True)
                else:
                    show(render(r))
                    sys.stdout.flush()
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:  # its reader went away (| head): the watch ends, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
