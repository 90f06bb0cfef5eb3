"""Exact recovery in the EPS core, without sockets: a rank dies at any point of a step, falls
silent, is declared dead, and a replacement redoes its step from the Welcome's resume point.
Every version the replacement reads must be bitwise the one a failure-free run read there, and
the final weights must be the failure-free run's.

The ranks are the in-process ones of test_core (fetch 0..L-1, push L-1..0, prefetch layer 0 of
the next step before the last push); hypothesis picks the victim, the moment it dies, the
interleaving, and whether the dead process comes back to life and tries to push.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eps_server.config import OptimizerConfig
from eps_server.errors import RequestError
from eps_server.peers import Peer, Peers
from protocol.lifecycle import process_gone, process_identity
from protocol.messages import (
    ANY_RANK,
    Ack,
    Bye,
    Error,
    Fetch,
    Heartbeat,
    Hello,
    LayerReady,
    PushGrad,
    Save,
    Status,
    Welcome,
    WorkerReport,
)

from .helpers import ENV
from .test_core import MANIFEST, PROTOCOL_VERSION, SGD, Harness, L, error, grad_of, value

STEPS = 3
TIMEOUT = 10.0


class Rank:
    """One rank's program from step ``start`` on; pushes of ``pushed`` layers in ``start`` are
    left out (the EPS has them). Records every version it reads."""

    def __init__(self, h: Harness, rank: int, identity: bytes, start: int = 0,
                 pushed: tuple[int, ...] = (), base: int = 0):
        self.h, self.rank, self.identity = h, rank, identity
        self.ids = iter(range(base + 1000 * (rank + 1), base + 1000 * (rank + 2)))
        self.actions = list(self._program(start, set(pushed)))
        self.pc = 0
        self.waiting: set[int] = set()
        self.prefetched: dict[tuple, int] = {}
        self.pushes: set[int] = set()
        self.read: dict[tuple[int, int], bytes] = {}  # (layer, version) -> the bytes served
        self.fetches: dict[int, tuple[int, int]] = {}

    def _program(self, start, pushed):
        for t in range(start, STEPS):
            for layer in range(L):
                yield ("fetch", layer, t)
            for layer in range(L - 1, -1, -1):
                yield ("fetch", layer, t)  # the backward visit reads the layer again
                if layer == 0 and t + 1 < STEPS:
                    yield ("prefetch", 0, t + 1)
                if not (t == start and layer in pushed):
                    yield ("push", layer, t)
            yield ("drain", None, t)

    @property
    def done(self) -> bool:
        return self.pc >= len(self.actions) and not self.waiting

    def runnable(self) -> bool:
        if self.waiting:
            box = self.h.inbox[self.identity]
            if not self.waiting <= {o.msg.req_id for o in box}:
                return False
            for rid in self.waiting:
                out = self.h.take(self.rank, rid, peer=self.identity)
                assert not isinstance(out.msg, Error), out.msg
                if isinstance(out.msg, LayerReady):
                    self._record(rid, out)
            self.waiting = set()
        return self.pc < len(self.actions)

    def _record(self, rid, out) -> None:
        layer, version = self.fetches.pop(rid)
        assert out.msg.version == version, (layer, version, out.msg)
        data = bytes(out.frames[0])
        assert self.read.setdefault((layer, version), data) == data
        self.read[layer, version] = data

    def act(self) -> None:
        what, layer, t = self.actions[self.pc]
        self.pc += 1
        if what in ("fetch", "prefetch"):
            rid = self.prefetched.pop((layer, t), None)
            if rid is None:
                rid = next(self.ids)
                self.fetches[rid] = (layer, t)
                self.h.send(self.rank, Fetch(req_id=rid, layer=layer, min_version=t),
                            peer=self.identity)
            if what == "prefetch":
                self.prefetched[layer, t] = rid
            else:
                self.waiting = {rid}
        elif what == "push":
            rid = next(self.ids)
            self.pushes.add(rid)
            self.h.send(self.rank, _push(t, layer, self.rank, rid), _frames(t, layer, self.rank),
                        peer=self.identity)
        else:
            self.waiting, self.pushes = self.pushes, set()

    def beat(self) -> None:
        self.h.send(self.rank, Heartbeat(req_id=next(self.ids)), peer=self.identity)


def _push(t, layer, rank, rid):
    return PushGrad(req_id=rid, step=t, layer=layer, rank=rank, slot=-1, dtype="float32")


def _frames(t, layer, rank):
    return [grad_of(layer, value(rank, t, layer)).view(torch.uint8).numpy()]


def drive(h: Harness, ranks: list[Rank], choices, until=None) -> None:
    """Move runnable ranks (or take in completions) as ``choices`` say, until every rank is
    done or ``until()`` holds; a deadlock fails."""
    for _ in range(20_000):
        if until is not None and until():
            return
        ready = [r for r in ranks if r.runnable()]
        if not ready:
            h.poll()
            if not any(r.runnable() for r in ranks):
                if all(r.done for r in ranks) or until is not None:
                    return
                raise AssertionError("deadlock: nobody can move: " + "; ".join(
                    f"rank {r.rank} at {r.actions[min(r.pc, len(r.actions)) - 1]} waiting "
                    f"{sorted(r.waiting)}" for r in ranks) + f"; versions {h.core.store.versions}; "
                    f"inboxes {dict(h.inbox)}")
            continue
        options = [*ready, None]
        pick = options[next(choices, 0) % len(options)]
        if pick is None:
            h.poll()
        else:
            pick.act()
    raise AssertionError("the schedule did not finish")


def failure_free(world_size, **server) -> tuple[list[torch.Tensor], dict]:
    h = Harness(world_size, **server)
    try:
        h.bootstrap()
        ranks = [Rank(h, r, h.peer(r)) for r in range(world_size)]
        drive(h, ranks, iter(()))
        h.poll()
        read = {}
        for r in ranks:
            read.update(r.read)
        return [h.master(layer, STEPS) for layer in range(L)], read
    finally:
        h.close()


def master(h: Harness, rank: Rank, layer: int) -> torch.Tensor:
    h.send(rank.rank, Fetch(req_id=999, layer=layer, min_version=STEPS, which="master"),
           peer=rank.identity)
    out = h.take(rank.rank, 999, peer=rank.identity)
    assert isinstance(out.msg, LayerReady) and out.msg.version == STEPS, out
    return torch.frombuffer(bytearray(out.frames[0]), dtype=torch.float32)


def hello(h: Harness, rank: int, identity: bytes, req_id: int):
    h.send(rank, Hello(req_id=req_id, protocol_version=PROTOCOL_VERSION, rank=rank,
                       world_size=h.cfg.world_size, manifest_hash=MANIFEST.hash(),
                       transport="frames", grad_dtype="float32"), peer=identity)
    return h.take(rank, req_id, peer=identity).msg


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world_size=st.integers(2, 3), update=st.sampled_from(["eager", "deferred"]),
       optimizer=st.sampled_from(["sgd", "adamw"]), clip=st.sampled_from([0.0, 100.0]),
       victim=st.integers(0, 2), death=st.integers(0, 10_000), revive=st.booleans(),
       choices=st.lists(st.integers(0, 7), max_size=300))
def test_a_replacement_redoes_the_step_exactly(world_size, update, optimizer, clip, victim,
                                               death, revive, choices):
    """``clip`` 100: with two ranks steps 0 and 1 stay below it and step 2 clips, with three
    every step clips, so eager AdamW updates speculatively, rolls back and holds, and a
    replacement reads layers whose speculative update waits for its own gradients."""
    opt = (OptimizerConfig(name="sgd", lr=0.5, weight_decay=0.0, clip_norm=clip)
           if optimizer == "sgd" else OptimizerConfig(name="adamw", lr=0.01, clip_norm=clip))
    server = dict(optimizer=opt, update=update, recovery=True, heartbeat_timeout=TIMEOUT)
    expected, reference_reads = failure_free(world_size, **server)
    victim %= world_size
    h = Harness(world_size, **server)
    try:
        h.bootstrap()
        ranks = [Rank(h, r, h.peer(r)) for r in range(world_size)]
        dying = ranks[victim]
        death %= len(dying.actions) + 1
        picks = iter(choices)
        drive(h, ranks, picks, until=lambda: dying.pc >= death)  # dies after its request
        # It dies: silent from now on. The others go on as far as they can.
        survivors = [r for r in ranks if r is not dying]
        drive(h, survivors, picks, until=lambda: False)
        h.now += TIMEOUT / 2
        for r in survivors:
            r.beat()
        h.now += TIMEOUT / 2 + 1
        lost = h.core.expire()
        assert [p.rank for p in lost] == [victim]
        if revive:  # the stopped process runs again: whatever it sends is refused
            out_of_date = list(h.core.store.versions)
            h.send(victim, _push(0, 0, victim, 1), _frames(0, 0, victim), peer=dying.identity)
            assert error(h.take(victim, 1, peer=dying.identity)).code == "not_registered"
            assert h.core.store.versions == out_of_date
        other = b"replacement"
        welcome = hello(h, victim, other, 77)
        assert welcome.rejoined, welcome
        new = Rank(h, victim, other, welcome.step, welcome.pushed, base=50_000)
        drive(h, [*survivors, new], picks)
        h.poll()
        got = [master(h, new, layer) for layer in range(L)]
    finally:
        h.close()
    for layer, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"layer {layer} differs"
    for key, data in new.read.items():  # the replacement read what the failure-free run read
        assert data == reference_reads[key], f"layer {key[0]} version {key[1]}"


def test_a_replacement_reads_a_speculatively_updated_layer_at_once(make):
    """Eager AdamW with --clip-norm updates layer 2 as soon as both ranks pushed it, but
    publishes nothing before the step is decided, which needs every rank's gradients. A
    replacement of rank 1 must read layer 2's version 0 then: from the retained copy the
    speculative update made, at once (waiting for the decision would wait for itself)."""
    adamw = OptimizerConfig(name="adamw", lr=0.01, clip_norm=1e9)
    h = make(2, optimizer=adamw, recovery=True, heartbeat_timeout=TIMEOUT)
    h.bootstrap()
    h.send(1, _push(0, 2, 1, 5), _frames(0, 2, 1))
    h.send(1, _push(0, 1, 1, 6), _frames(0, 1, 1))
    h.send(0, _push(0, 2, 0, 7), _frames(0, 2, 0))
    h.poll()
    assert h.core.store.versions == [0, 0, 0] and 2 in h.core.scheduler.retained
    h.now = TIMEOUT + 1
    h.send(0, Heartbeat(req_id=8))
    assert [p.rank for p in h.core.expire()] == [1]
    welcome = hello(h, 1, b"new", 9)
    assert welcome.rejoined and welcome.step == 0 and welcome.pushed == (1, 2)
    for layer in (2, 1, 0):
        h.send(1, Fetch(req_id=20 + layer, layer=layer, min_version=0), peer=b"new")
        out = h.take(1, 20 + layer, peer=b"new")
        assert isinstance(out.msg, LayerReady) and out.msg.version == 0, (layer, out)
        assert torch.equal(torch.frombuffer(bytearray(out.frames[0]), dtype=torch.float32),
                           torch.ones(h.core.store.plan(layer).numel)), layer
    h.send(1, _push(0, 0, 1, 30), _frames(0, 0, 1), peer=b"new")
    for layer in (1, 0):
        h.send(0, _push(0, layer, 0, 40 + layer), _frames(0, layer, 0))
    h.poll()
    assert h.core.store.versions == [1, 1, 1]


def test_without_recovery_a_replacement_that_cannot_redo_exactly_is_refused(make):
    h = make(2, heartbeat_timeout=TIMEOUT)
    h.bootstrap()
    h.send(1, _push(0, 2, 1, 5), _frames(0, 2, 1))  # rank 1 pushed layer 2 of step 0, then died
    h.poll()
    assert h.take(1, 5) is None  # held until rank 0's part comes
    h.send(0, Heartbeat(req_id=6))
    h.send(0, Fetch(req_id=9, layer=2, min_version=1))  # waits for rank 1's part
    h.now = TIMEOUT + 1
    h.send(0, Heartbeat(req_id=7))
    assert [p.rank for p in h.core.expire()] == [1]
    h.poll()  # rank 0 is not left waiting for a part nobody can send: it is told why
    assert "no replacement can redo its part" in h.take(0, 9).msg.message
    refused = hello(h, 1, b"new", 8)
    assert isinstance(refused, Error) and "--recovery" in refused.message
    assert h.core.peers.ranks() == (0,)  # nothing registered


def test_a_rank_that_says_bye_mid_step_without_recovery_tells_the_others(make):
    h = make(2, heartbeat_timeout=TIMEOUT)
    h.bootstrap()
    h.send(1, _push(0, 2, 1, 5), _frames(0, 2, 1))
    h.poll()
    h.send(0, Fetch(req_id=9, layer=2, min_version=1))
    h.send(1, Bye(req_id=6, rank=1, done=False))  # it failed, and said so
    told = h.take(0, 9).msg.message
    assert "rank 1 left in the middle of step 0" in told
    # what to do next, without pointing at a checkpoint there is none of (a Ctrl-C said so)
    assert "there is no checkpoint to restart it from" in told and "last checkpoint" not in told
    assert isinstance(h.take(1, 6).msg, Ack)


@pytest.mark.parametrize("how", ["bye_done", "observer", "other_rank"])
def test_a_rank_gone_mid_step_by_any_route_tells_the_others(make, how):
    """A rank that leaves in the middle of its step is lost whatever it says: a Bye claiming
    it is done is taken as a failure's, and its connection cannot become an observer or another
    rank (its rank vanished unaccounted for, and the others waited for it forever)."""
    h = make(3, heartbeat_timeout=TIMEOUT)
    h.bootstrap()
    h.send(1, _push(0, 2, 1, 5), _frames(0, 2, 1))
    h.poll()
    h.send(0, Fetch(req_id=9, layer=2, min_version=1))
    if how == "bye_done":
        h.send(1, Bye(req_id=6, rank=1, done=True))
        assert isinstance(h.take(1, 6).msg, Ack)
        assert "rank 1 left in the middle of step 0" in h.take(0, 9).msg.message
        assert h.core.broken is not None and 1 not in h.core.peers.done_ranks
        return
    fields = dict(protocol_version=PROTOCOL_VERSION, world_size=3,
                  manifest_hash=MANIFEST.hash(), transport="frames", grad_dtype="float32")
    if how == "observer":
        h.send(1, Hello(req_id=6, role="observer", **fields))
    else:
        h.send(1, Bye(req_id=4, rank=2, done=False), peer=Harness.peer(2))  # rank 2 is free
        h.take(2, 4)
        h.send(1, Hello(req_id=6, rank=2, **fields))
    refused = error(h.take(1, 6))
    assert refused.code == "bad_request" and "this connection is rank 1" in refused.message
    assert 1 in h.core.peers.ranks() and h.core.broken is None  # still rank 1, still awaited


def test_a_save_waiting_for_its_boundary_is_told_when_the_server_breaks(make, tmp_path):
    """The boundary a Save waits for never comes once a rank is lost mid-step: its requester
    gets an internal Error (l2l-ctl save waited out its hour-long timeout)."""
    h = make(2, heartbeat_timeout=TIMEOUT)
    h.bootstrap()
    for rank, rid in ((0, 5), (1, 6)):
        h.send(rank, _push(0, 2, rank, rid), _frames(0, 2, rank))
    h.poll()
    assert h.core.store.versions == [0, 0, 1]
    h.send(0, Save(req_id=20, path=str(tmp_path / "ckpt")))  # waits for every layer at 1
    h.poll()
    assert h.take(0, 20) is None
    h.send(1, Bye(req_id=7, rank=1, done=False))
    told = error(h.take(0, 20))
    assert told.code == "internal" and "rank 1 left in the middle of step 0" in told.message
    assert os.listdir(tmp_path / "ckpt") == [".lock"]  # (made by the Save's check) no step


def test_a_rank_that_leaves_between_steps_leaves_no_one_stranded(make):
    """Without --recovery a rank gone before pushing any of its step can be replaced: the
    others' Fetches still wait, and the replacement is welcomed."""
    h = make(2, heartbeat_timeout=TIMEOUT)
    h.bootstrap()
    h.send(0, Fetch(req_id=9, layer=2, min_version=1))
    h.now = TIMEOUT + 1
    h.send(0, Heartbeat(req_id=7))
    assert [p.rank for p in h.core.expire()] == [1]
    h.poll()
    assert h.take(0, 9) is None and h.core.broken is None
    welcome = hello(h, 1, b"new", 8)
    assert welcome.rejoined and welcome.step == 0


def test_resume_points(make):
    """Welcome.step and .pushed for a rank that died before, in and after its step's pushes."""
    h = make(2, recovery=True, heartbeat_timeout=TIMEOUT)
    h.bootstrap()
    core = h.core
    assert core.data.resume_point(1) == (0, ())
    h.send(1, _push(0, 2, 1, 5), _frames(0, 2, 1))
    h.poll()
    assert core.data.resume_point(1) == (0, (2,))
    assert core.data.resume_point(0) == (0, ())
    for layer, rid in ((2, 10), (1, 11)):
        h.send(0, _push(0, layer, 0, rid), _frames(0, layer, 0))
    h.poll()  # layer 2 is updated (both pushed); layer 1 has rank 0's part only
    assert core.store.versions == [0, 0, 1]
    assert core.data.resume_point(1) == (0, (2,))
    assert core.data.resume_point(0) == (0, (1, 2))
    for layer, rid in ((1, 6), (0, 7)):
        h.send(1, _push(0, layer, 1, rid), _frames(0, layer, 1))
    h.poll()
    assert core.data.resume_point(1) == (1, ())  # all of step 0 in: it goes on with step 1
    h.send(0, _push(0, 0, 0, 12), _frames(0, 0, 0))
    h.poll()
    assert core.store.versions == [1, 1, 1] and core.data.resume_point(0) == (1, ())


def test_a_replacement_waiting_for_a_layer_under_update_gets_the_version_it_replaces(make):
    """Layers 2 and 1 are being updated (sent to the engines, not done) when the replacement
    asks for layer 1's version 0; layer 2's update finishes first. The answer must wait for
    layer 1's update and come from the retained copy: never the bytes the update rewrites."""
    h = make(2, optimizer=SGD, recovery=True, heartbeat_timeout=TIMEOUT)
    h.bootstrap()
    before = bytes(h.master(1, 0).numpy())
    held, submit = [], h.core.engines.submit
    h.core.engines.submit = lambda job: held.append(job) if type(job).__name__ == "Update" \
        else submit(job)
    for req_id, layer in ((11, 2), (12, 1)):  # rank 1 pushes two layers, then dies
        h.send(1, _push(0, layer, 1, req_id), _frames(0, layer, 1))
    h.poll()
    h.now += TIMEOUT + 1
    h.send(0, Heartbeat(req_id=13))  # rank 0 is alive
    h.core.expire()
    welcome = hello(h, 1, b"new-1", 20)
    assert (welcome.step, welcome.pushed) == (0, (1, 2))
    for req_id, layer in ((21, 2), (22, 1)):
        h.send(0, _push(0, layer, 0, req_id), _frames(0, layer, 0))
    h.poll()
    assert [job.layer for job in held] == [2, 1]  # both updates sent, neither done
    h.send(1, Fetch(req_id=30, layer=1, min_version=0), peer=b"new-1")
    submit(held.pop(0))  # layer 2's update finishes
    h.poll()
    assert h.take(1, 30, peer=b"new-1") is None, "answered while layer 1 was being rewritten"
    submit(held.pop(0))
    h.poll()
    out = h.take(1, 30, peer=b"new-1")
    assert isinstance(out.msg, LayerReady) and out.msg.version == 0
    assert bytes(out.frames[0]) == before
    assert bytes(h.master(1, 1).numpy()) != before  # the layer itself did move on


def test_any_rank_hellos_get_the_lowest_free_rank_and_a_replica_takes_a_dead_ones(make):
    """Identical replicas (Hello rank -1) get ranks 0, 1; a third is refused while both live;
    once rank 0 is declared dead a new replica takes rank 0 and resumes its step."""
    h = make(2, recovery=True, heartbeat_timeout=TIMEOUT)
    welcomes = [hello(h, ANY_RANK, name, 1) if i else h.hello(ANY_RANK, peer=name)
                for i, name in enumerate((b"a", b"b"))]
    assert [w.rank for w in welcomes] == [0, 1]
    assert welcomes[0].init_layers == tuple(range(L)) and welcomes[1].init_layers == ()
    assert hello(h, ANY_RANK, b"a", 2).rank == 0  # the same connection again: its own rank
    refused = hello(h, ANY_RANK, b"c", 3)
    assert isinstance(refused, Error) and refused.code == "rank_taken"
    h.now = TIMEOUT / 2
    h.send(0, Heartbeat(req_id=4), peer=b"b")
    h.now = TIMEOUT + 1  # "a" silent for longer than the timeout, "b" not
    replica = hello(h, ANY_RANK, b"c", 5)
    assert isinstance(replica, Welcome), replica
    assert replica.rank == 0 and replica.rejoined and replica.step == 0
    assert h.core.peers.ranks() == (0, 1)


def test_heartbeat_reports_reach_status(make):
    h = make(2, heartbeat_timeout=TIMEOUT)
    h.bootstrap()
    report = WorkerReport(steps=3, loss=0.5, step_seconds=0.2, fetch_wait=0.01, push_wait=0.02,
                          samples_per_sec=80.0, memory=1 << 20, peak_memory=2 << 20)
    h.send(1, Heartbeat(req_id=5, report=report))
    h.send(0, Heartbeat(req_id=6))  # no report yet: nothing shown for rank 0
    assert isinstance(h.take(1, 5).msg, Ack) and isinstance(h.take(0, 6).msg, Ack)
    h.send(0, Status(req_id=7))
    workers = h.take(0, 7).msg.workers
    assert [(w.rank, w.report) for w in workers] == [(0, None), (1, report)]


def test_any_rank_skips_finished_ranks(make):
    h = make(2, heartbeat_timeout=TIMEOUT)
    h.bootstrap()
    h.send(0, Bye(req_id=5, rank=0, done=True))
    assert isinstance(h.take(0, 5).msg, Ack)
    refused = hello(h, ANY_RANK, b"late", 6)  # rank 0 finished, rank 1 alive: nothing free
    assert isinstance(refused, Error) and refused.code == "rank_taken"


def test_reports_out_of_range_are_refused():
    ok = dict(steps=1, loss=float("nan"), step_seconds=0.1, fetch_wait=0.0, push_wait=0.0,
              samples_per_sec=1.0, memory=0, peak_memory=0)
    assert WorkerReport(**ok)  # a NaN loss is a figure to show, not an error
    for field, bad in (("step_seconds", float("nan")), ("fetch_wait", -1.0),
                       ("samples_per_sec", float("inf")), ("memory", -1)):
        with pytest.raises(ValueError):
            WorkerReport(**{**ok, field: bad})


def live_process() -> tuple[subprocess.Popen, str]:
    """A real process (it exits when its stdin is closed) and its process identity."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; from protocol.lifecycle import "
                              "process_identity; print(process_identity(), flush=True); "
                              "sys.stdin.read()"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=ENV)
    return child, child.stdout.readline().strip()


def test_a_holder_whose_process_has_exited_is_replaced_at_once(make, caplog):
    """``Hello.process`` names the worker's process (a real one here): while it lives its rank
    is kept (a replacement gets rank_taken); once it has exited, a replacement takes the rank
    at once, long before the heartbeat timeout, and the dead holder is reported lost. A name
    from another machine or PID namespace is never judged from /proc."""
    child, process = live_process()
    try:
        assert process.count(":") == 3 and not process_gone(process)
        h = make(2, heartbeat_timeout=TIMEOUT)
        assert isinstance(h.hello(0), Welcome)
        assert isinstance(h.hello(1, process=process, pid=child.pid), Welcome)
        replacement = dict(rank=1, peer=b"replacement", process=process_identity())
        taken = h.hello(req_id=2, **replacement)
        assert isinstance(taken, Error) and taken.code == "rank_taken", taken  # alive
        assert h.core.expire() == []
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert process_gone(process)
    with caplog.at_level("WARNING", logger="eps_server"):
        welcome = h.hello(req_id=3, **replacement)  # no time has passed: h.now is unchanged
    assert isinstance(welcome, Welcome) and welcome.rank == 1, welcome
    assert f"rank 1 (pid {child.pid}) declared dead: its process" in caplog.text
    assert [p.rank for p in h.core.expire()] == [1]  # the launcher hears of it
    machine, pid, start = process.rsplit(":", 2)
    assert not process_gone(f"another-boot:{machine.split(':')[1]}:{pid}:{start}")
    assert not process_gone(f"{machine.split(':')[0]}:1:{pid}:{start}")  # another namespace
    assert not process_gone("") and not process_gone("not an identity")


def test_one_key_for_several_ranks_cannot_displace_a_live_process():
    """With CURVE, a Hello with the holder's key replaces the holder (its worker reconnecting)
    only from the holder's own process, or when the holder's process is not seen alive; a
    launcher that gives every worker one key no longer lets one live rank take another's."""
    child, process = live_process()
    peers = Peers(world_size=2, timeout=TIMEOUT)
    holder = Peer(b"holder", 0, None, "float32", child.pid, b"key", process=process)
    try:
        peers.register(holder)
        with pytest.raises(RequestError, match="another live process"):
            peers.check_free(0, b"other", b"key", process_identity())
        assert peers.check_free(0, b"new-socket", b"key", process) is holder  # reconnected
        with pytest.raises(RequestError, match="held by a live connection"):
            peers.check_free(0, b"other", b"another key", process)
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert peers.check_free(0, b"other", b"key", process_identity()) is holder  # it exited
    holder.process = ""  # a holder that cannot be seen: the key decides, as before
    assert peers.check_free(0, b"other", b"key", process_identity()) is holder


def test_a_bye_read_after_its_process_exited_still_counts(make):
    """A worker that said Bye(done) and exited may be seen gone before the EPS reads its Bye;
    the Bye is still answered and its rank counts as done (--exit-when-done needs it)."""
    child, process = live_process()
    h = make(2, heartbeat_timeout=TIMEOUT)
    assert isinstance(h.hello(0), Welcome)
    assert isinstance(h.hello(1, process=process, pid=child.pid), Welcome)
    child.stdin.close()
    child.wait(timeout=30)
    assert [p.rank for p in h.core.expire()] == [1]
    h.send(1, Bye(req_id=9, rank=1, done=True))
    assert isinstance(h.take(1, 9).msg, Ack)
    assert h.core.peers.done_ranks == {1} and not h.core.all_done
    h.send(1, Bye(req_id=10, rank=1, done=True))  # only once
    assert error(h.take(1, 10)).code == "not_registered"
    # Once another connection has held the rank, the late Bye speaks for nobody.
    peers = Peers(world_size=2, timeout=TIMEOUT)
    peers.register(Peer(b"old", 1, None, "float32", child.pid, process=process))
    assert [p.rank for p, _ in peers.expire()] == [1]
    peers.register(Peer(b"new", 1, None, "float32", 0))
    peers.leave(b"new", done=False)
    assert not peers.late_bye(b"old", 1, True) and peers.done_ranks == set()


@pytest.mark.parametrize("unshare", [["-pf", "--kill-child"], ["-T", "--boottime", "100000"]],
                         ids=["pid namespace, parent's /proc", "time namespace"])
def test_where_proc_misleads_no_process_is_judged(unshare):
    """In a PID namespace whose /proc is its parent's (unshare without --mount-proc, some
    sandboxes) pids read there mean other processes; in a time namespace with offsets the
    start times read there are shifted. The worker names no process there, and an EPS there
    judges none, so nobody alive is declared dead from a misread."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here")
    code = ("from protocol.lifecycle import process_alive, process_identity; "
            "i = process_identity(); print(repr(i), process_alive(i), "
            "process_alive(" + repr(process_identity()) + "))")
    r = subprocess.run(["unshare", *unshare, sys.executable, "-c", code], env=ENV,
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        pytest.skip(f"unshare {unshare[0]} is not allowed here: {r.stderr.strip()[-200:]}")
    assert r.stdout.split() == ["''", "None", "None"], r.stdout
