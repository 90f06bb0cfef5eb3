"""Every box's status on every box (``--nodes``): each EPS publishes its summary in the boxes'
store and reads the others'; a Status reply carries them all (StatusReply.boxes) without ever
waiting on the store, and shows a box that stopped publishing as stale, and every other box as
unknown once the store (box 0's) does not answer or is gone."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from eps_server import box_status
from eps_server.box_status import BoxBoard
from eps_server.config import BoxesConfig, ServerConfig
from eps_server.stats import EpsStats
from protocol import codec
from protocol.box_info import BoxInfo
from protocol.messages import StatusReply

from .helpers import ENV, free_port

STORE = """import datetime, sys, time
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                  timeout=datetime.timedelta(seconds=30))
print("up", flush=True)
time.sleep(600)
"""


@pytest.fixture
def store_port():
    """Box 0's store, here."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    yield store.port
    del store


@pytest.fixture
def store_server():
    """Box 0's store, in a process of its own (so that it can be stopped and killed)."""
    port = free_port()
    p = subprocess.Popen([sys.executable, "-c", STORE, str(port)], env=ENV,
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert p.stdout.readline() == "up\n"
        yield p, port
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def client(port: int):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    store.set_timeout(datetime.timedelta(seconds=box_status.STORE_TIMEOUT))
    return dist.PrefixStore(box_status.PREFIX, store)


def boards(port: int, n: int) -> tuple[list[BoxBoard], list[EpsStats]]:
    """``n`` boxes' boards (no model yet: the lobby's summaries), reading every 0.2 s."""
    made, stats = [], []
    for r in range(n):
        cfg = ServerConfig(world_size=2, boxes=BoxesConfig(nodes=n, node_rank=r))
        stats.append(EpsStats())
        made.append(BoxBoard(cfg, stats[-1], lambda: None, store=client(port)))
        made[-1].read_every, made[-1].stale = 0.2, 1.5
    return made, stats


def wait_for(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (got := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return got


def states(board: BoxBoard) -> list[str]:
    t0 = time.monotonic()
    view = board.view()
    assert time.monotonic() - t0 < 0.05  # never waits on the store
    return [b.state for b in view]


def test_every_box_sees_every_box_and_a_completed_step_within_a_read(store_port):
    port = store_port
    made, stats = boards(port, 3)
    try:
        for board in made:
            wait_for(lambda: states(board) == ["ok"] * 3)
        view = made[2].view()
        assert [b.box for b in view] == [0, 1, 2] and view[2].age == 0.0
        assert all(b.world_size == 2 and b.workers == 0 and b.last_checkpoint == -1
                   and b.host and not b.lost and 0 <= b.age < 1.5 for b in view)
        stats[1].steps_completed, stats[1].last_checkpoint_step = 7, 6
        box1 = wait_for(lambda: [b for b in made[0].view()[1:2] if b.steps_completed == 7],
                        timeout=2.0)[0]  # published at once, read within 0.2 s
        assert box1.last_checkpoint == 6 and box1.state == "ok"
        made[2].close()  # box 2 stops publishing: the others see it stale, not gone
        assert wait_for(lambda: states(made[0]), 5.0) and wait_for(
            lambda: states(made[0]) == ["ok", "ok", "stale"], 5.0)
    finally:
        for board in made:
            board.close()


def test_a_box_never_published_is_missing(store_port):
    port = store_port
    cfg = ServerConfig(world_size=1, boxes=BoxesConfig(nodes=3, node_rank=1))
    board = BoxBoard(cfg, EpsStats(), lambda: None, store=client(port))
    try:
        board.read_every = 0.2
        wait_for(lambda: states(board) == ["missing", "ok", "missing"])
    finally:
        board.close()


def test_a_stopped_store_makes_the_others_unknown_and_a_dead_one_is_left_alone(
        store_server):
    """Box 0 (the store's host) stopped: reads wait on the socket, whatever the timeout, but
    only the board's thread waits; the others are unknown once the last read is stale, and
    come back once it runs again. Killed: the store fails, is not used again, nothing hangs."""
    proc, port = store_server
    made, _ = boards(port, 2)
    try:
        wait_for(lambda: states(made[1]) == ["ok", "ok"])
        os.kill(proc.pid, signal.SIGSTOP)
        wait_for(lambda: states(made[1]) == ["unknown", "ok"], 5.0)
        box0 = made[1].view()[0]
        assert box0.age > 1.5 and box0.world_size == 2  # the values last read
        os.kill(proc.pid, signal.SIGCONT)
        wait_for(lambda: states(made[1]) == ["ok", "ok"], 5.0)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        for board in made:
            wait_for(lambda: board.failed, 5.0)
            wait_for(lambda: states(board)[1 - board.box] == "unknown", 5.0)
            t0 = time.monotonic()
            board.close()
            assert time.monotonic() - t0 < 1.0
    finally:
        for board in made:
            board.close()


class Core:
    """What a board reads of an EPS core."""

    def __init__(self):
        self.all_done = False
        self.store = SimpleNamespace(versions=[3, 4])
        self.peers = SimpleNamespace(snapshot=list, clock=time.monotonic)
        self.engines = SimpleNamespace(boxes=None)


def test_box_0_done_waits_a_moment_for_the_others_to_be_done(store_port, monkeypatch):
    """Box 0 hosts the store: at its end it lingers until the other boxes are done too (each
    then says so and leaves the store alone), at most LINGER s."""
    port = store_port
    monkeypatch.setattr(box_status, "LINGER", 1.0)
    cores = [Core(), Core()]
    made = [BoxBoard(ServerConfig(world_size=1, boxes=BoxesConfig(nodes=2, node_rank=r)),
                     EpsStats(), lambda r=r: cores[r], store=client(port)) for r in range(2)]
    try:
        made[0].read_every = 0.2
        wait_for(lambda: states(made[0]) == ["ok", "ok"])
        assert made[0].view()[1].step == 3 and made[0].view()[1].newest == 4
        cores[0].all_done = True
        t0 = time.monotonic()
        made[0].close(cores[0])  # box 1 still works: the whole LINGER
        assert 1.0 <= time.monotonic() - t0 < 2.0
        made[0] = BoxBoard(made[0].cfg, EpsStats(), lambda: cores[0], store=client(port))
        cores[1].all_done = True
        published = made[1].published
        wait_for(lambda: made[1].published > published)
        time.sleep(0.5)
        assert made[1].published == published + 1  # said once, then the store is left alone
        t0 = time.monotonic()
        made[0].close(cores[0])
        assert time.monotonic() - t0 < 0.9  # box 1 is done: no need to wait
    finally:
        for board in made:
            board.close()


def test_the_reply_carries_every_box_and_leaves_them_off_the_wire_when_one():
    """A one-box EPS's StatusReply has no ``boxes`` on the wire: a client that predates it
    (unknown fields are refused) still reads it."""
    import msgpack

    reply = StatusReply(req_id=3, run_id="r", step=1, versions=(1,), world_size=1, ranks=(0,),
                        stats={})
    body = msgpack.unpackb(codec.encode(reply)[1])
    assert "boxes" not in body and "updated_ms" in body
    boxes = (BoxInfo(box=0, state="ok", age=0.0, host="a", step=4, newest=5),
             BoxInfo(box=1, state="unknown"))
    wire = codec.encode(StatusReply(**{**reply.__dict__, "boxes": boxes}))
    back, _ = codec.decode(wire)
    assert back.boxes == boxes
    body = msgpack.unpackb(wire[1])
    body["boxes"][1]["state"] = "fine"
    with pytest.raises(codec.DecodeError, match="state"):
        codec.decode([wire[0], msgpack.packb(body)])


def test_status_shows_one_line_per_box():
    from rich.console import Console

    from launch.status import as_json, render

    boxes = (BoxInfo(box=0, state="ok", age=0.0, host="alpha", step=4, newest=5, workers=2,
                     alive=2, world_size=2, last_checkpoint=4),
             BoxInfo(box=1, state="stale", age=9.5, host="beta", step=3, newest=3, lost=True),
             BoxInfo(box=2, state="unknown"))
    reply = StatusReply(req_id=1, run_id="r", step=4, versions=(4, 5), world_size=2,
                        ranks=(0, 1), stats={}, boxes=boxes)
    console = Console(width=200, record=True)
    console.print(render(reply))
    text = console.export_text()
    lines = [line for line in text.splitlines() if "alpha" in line or "beta" in line
             or " unknown " in line]
    assert len(lines) == 3, text
    assert "4..5" in lines[0] and "2 / 2 / 2" in lines[0] and "stale" in lines[1]
    assert "lost" in lines[1] and "9.5 s ago" in lines[1]
    assert as_json(reply)["boxes"][1]["state"] == "stale"
    console = Console(width=200, record=True)
    console.print(render(StatusReply(**{**reply.__dict__, "boxes": boxes[:1]})))
    assert "alpha" not in console.export_text()  # one box: no table of boxes


def eps_of(endpoint: str) -> int:
    from .test_launch import processes_with

    [pid] = [pid for pid in processes_with(endpoint) if b"eps_server" in
             open(f"/proc/{pid}/cmdline", "rb").read()]
    return pid


def stop(procs) -> None:
    """The boxes' launchers stopped as a user would (they stop their children), else killed."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()


def test_status_on_any_box_shows_every_box_and_box_0_gone_leaves_the_others_answering(
        tmp_path):
    """Two loopback boxes: l2l-ctl status on either shows both, fresh and training. Box 0's
    EPS (the store's host) is stopped: box 1 answers at once, box 0 soon unknown; then killed:
    box 1 fails the job within --box-timeout, saying so, and leaves nothing behind."""
    import json

    from worker.eps_client import EpsClient

    from .test_boxes import boxes
    from .test_launch import assert_nothing_left
    from .test_status import CTL

    procs = boxes(tmp_path, 2, "--box-timeout", "15", "--steps", "100000", "--log-every",
                  "100000")
    endpoints = [f"ipc://{tmp_path}/box{r}/eps.sock" for r in range(2)]
    stopped, clients = None, {}
    try:
        def seen(r: int) -> tuple[BoxInfo, ...]:
            assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
            if r not in clients:
                if not (tmp_path / f"box{r}" / "eps.sock").exists():
                    return ()
                clients[r] = EpsClient(endpoints[r], timeout=5)
            return clients[r].status(timeout=5).boxes

        for r in range(2):  # both boxes fresh, each past its first steps, on either box
            wait_for(lambda: len(b := seen(r)) == 2 and all(
                x.state == "ok" and x.steps_completed >= 2 and x.alive == 1 for x in b), 90)
        table = subprocess.run([*CTL, "--endpoint", endpoints[1], "status"], env=ENV,
                               capture_output=True, text=True, timeout=60)
        assert table.returncode == 0, table.stderr
        rows = [line for line in table.stdout.splitlines() if " ok " in line and " s ago" in line]
        assert len(rows) == 2 and "boxes" in table.stdout, table.stdout
        as_json = subprocess.run([*CTL, "--endpoint", endpoints[0], "status", "--json"],
                                 env=ENV, capture_output=True, text=True, timeout=60)
        assert [b["box"] for b in json.loads(as_json.stdout)["boxes"]] == [0, 1], as_json.stderr
        stopped = eps_of(endpoints[0])
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        box0 = wait_for(lambda: [b for b in seen(1)[:1] if b.state == "unknown"], 15)[0]
        # unknown once its last read is over STALE old; its age is shown to 3 decimals
        assert time.monotonic() - t0 < box_status.STALE + 5 and box0.age >= box_status.STALE
        assert seen(1)[1].state == "ok"  # box 1 itself, as it is now
        os.kill(stopped, signal.SIGKILL)
        t0 = time.monotonic()
        try:
            code = procs[1].wait(timeout=15 + 30)  # --box-timeout, and the launcher's stop
        except subprocess.TimeoutExpired:
            pytest.fail(f"box 1 still runs {time.monotonic() - t0:.0f} s after box 0 died")
        assert code == 1
        s = json.loads((tmp_path / "box1" / "s.json").read_text())
        eps = (tmp_path / "box1" / "runs" / s["run_id"] / "eps.log").read_text()
        assert "boxes failed (a box died or is cut off?)" in eps, eps
        assert_nothing_left(endpoints[1], s["run_id"])
        assert procs[0].wait(timeout=30) == 1  # box 0's launcher, its EPS gone, tidies up
        s = json.loads((tmp_path / "box0" / "s.json").read_text())
        assert_nothing_left(endpoints[0], s["run_id"])
    finally:
        for c in clients.values():
            c.close()
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        stop(procs)
