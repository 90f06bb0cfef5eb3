"""The EPS core driven in-process: no sockets, no processes, inline engines (each job runs when
it is submitted; its completion waits until the test polls). The tests choose the order of
every request and when completions are taken in (inline, they finish in submission order; the
threaded engines are tested on their own at the end).

Gradients are small integers, so their sums are exact in fp32 whatever the order of addition:
any two schedules of the same pushes must end with bitwise equal weights.
"""

from __future__ import annotations

import json
import math
import os
import queue
import secrets
import threading
import time
from collections import defaultdict
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eps_server.config import OptimizerConfig, ServerConfig
from eps_server.core import EpsCore
from eps_server.engines import Engines
from eps_server.jobs import (
    Action,
    Done,
    Exclusive,
    Part,
    PushTicket,
    SaveTicket,
    Update,
    Updated,
)
from eps_server.layer_math import Checked
from eps_server.lobby import Lobby
from eps_server.scheduler import Publish, Saved, UpdateScheduler
from eps_server.stats import EpsStats
from protocol.messages import (
    PROTOCOL_VERSION,
    Ack,
    Bye,
    Error,
    Fetch,
    GradAck,
    Heartbeat,
    Hello,
    InitLayer,
    LayerReady,
    PushGrad,
    Save,
    SetHyper,
    Status,
)
from protocol.tensors import LayerSpec, Manifest, TensorSpec, plan_layout, views
from worker.models.loaders import init_frame

MANIFEST = Manifest(layers=tuple(
    LayerSpec(name=f"l{i}", kind="k", tensors=(TensorSpec(name="w", shape=(4, 8)),
                                               TensorSpec(name="b", shape=(8,), group="no_decay")))
    for i in range(3)), meta={"model": "core-test"})
LAYOUT = plan_layout(MANIFEST)
L = len(LAYOUT.layers)
SGD = OptimizerConfig(name="sgd", lr=0.5, weight_decay=0.0)


class Harness:
    """One core and its peers' inboxes. ``peer(r)`` is rank r's connection identity."""

    def __init__(self, world_size=1, optimizer=SGD, manifest=MANIFEST, **server):
        self.manifest, self.layout = manifest, plan_layout(manifest)
        self.cfg = ServerConfig(world_size=world_size, run_id="c" + secrets.token_hex(4),
                                optimizer=optimizer, **server)
        self.now = 0.0  # the core's clock: tests move it (heartbeat timeouts)
        self.lobby = Lobby(self.cfg, self.cfg.run_id, EpsStats(), inline=True,
                           clock=lambda: self.now)
        self.core: EpsCore | None = None
        self.inbox: dict[bytes, list] = defaultdict(list)

    @staticmethod
    def peer(rank: int) -> bytes:
        return f"rank{rank}".encode()

    def send(self, rank, msg, frames=(), peer=None):
        peer = peer or self.peer(rank)
        frames = [memoryview(f) for f in frames]
        if self.core is None:
            self.core, outs = self.lobby.handle(peer, msg, frames)
        else:
            outs = self.core.handle(peer, msg, frames)
        self._deliver(outs)

    def poll(self) -> None:
        self._deliver(self.core.poll())

    def _deliver(self, outs):
        for out in outs:
            self.inbox[out.peer].append(out)

    def take(self, rank, req_id, peer=None):
        """Remove and return the reply to ``req_id`` (None if it has not come)."""
        box = self.inbox[peer or self.peer(rank)]
        for i, out in enumerate(box):
            if out.msg.req_id == req_id:
                return box.pop(i)
        return None

    def hello(self, rank, req_id=1, peer=None, **kw):
        fields = dict(protocol_version=PROTOCOL_VERSION, rank=rank,
                      world_size=self.cfg.world_size, manifest_hash=self.manifest.hash(),
                      manifest=self.manifest, transport="frames", grad_dtype="float32")
        fields.update(kw)
        self.send(rank, Hello(req_id=req_id, **fields), peer=peer)
        return self.take(rank, req_id, peer=peer).msg

    def bootstrap(self, value=1.0, grad_dtype="float32", **hello):
        for r in range(self.cfg.world_size):
            welcome = self.hello(r, grad_dtype=grad_dtype, **hello)
            assert welcome.init_layers == (tuple(range(L)) if r == 0 else ())
        for plan in self.layout.layers:
            self.send(0, InitLayer(req_id=100 + plan.index, layer=plan.index),
                      [torch.full((plan.numel,), value).numpy()])
        self.poll()
        assert all(isinstance(self.take(0, 100 + i).msg, Ack) for i in range(L))

    def push(self, rank, step, layer, grad, req_id, dtype="float32"):
        self.send(rank, PushGrad(req_id=req_id, step=step, layer=layer, rank=rank, slot=-1,
                                 dtype=dtype), [grad.contiguous().view(torch.uint8).numpy()])

    def master(self, layer, version, rank=0, which="master") -> torch.Tensor:
        self.send(rank, Fetch(req_id=999, layer=layer, min_version=version, which=which))
        out = self.take(rank, 999)
        assert isinstance(out.msg, LayerReady) and out.msg.version == version, out
        return torch.frombuffer(bytearray(out.frames[0]), dtype=torch.float32)

    def close(self):
        if self.core is not None:
            self.core.close(final_save=False)


def grad_of(layer, value, dtype=torch.float32):
    """``value`` in every element of the layer's tensors, zero padding."""
    g = torch.zeros(LAYOUT.layers[layer].numel, dtype=dtype)
    for v in views(g, LAYOUT.layers[layer]):
        v.fill_(value)
    return g


def value(rank, step, layer) -> int:
    return (rank + 1) * (step + 1) + layer  # integers: every sum is exact


def error(out) -> Error:
    assert out is not None and isinstance(out.msg, Error), out
    return out.msg


# ----------------------------------------------------------------------------- interleavings


class Worker:
    """A rank as the core sees it: each step fetches layers 0..L-1 (each waited for), pushes
    L-1..0 and prefetches layer 0 of the next step before its last push, as the executor does."""

    def __init__(self, h: Harness, rank: int, steps: int):
        self.h, self.rank = h, rank
        self.ids = iter(range(1000 * (rank + 1), 1000 * (rank + 2)))
        self.program = iter(self._program(steps))
        self.waiting: set[int] = set()  # req_ids whose replies must come before acting
        self.prefetched: dict[tuple, int] = {}  # (layer, step) -> req_id of an early Fetch
        self.pushes: set[int] = set()  # this step's pushes, acked by the end of the step
        self.done = False

    def _program(self, steps):
        for t in range(steps):
            for layer in range(L):
                yield ("fetch", layer, t)
            for layer in range(L - 1, -1, -1):
                if layer == 0 and t + 1 < steps:
                    yield ("prefetch", 0, t + 1)
                yield ("push", layer, t)
            yield ("drain", None, t)

    def runnable(self) -> bool:
        if self.done:
            return False
        if self.waiting:
            box = self.h.inbox[self.h.peer(self.rank)]
            arrived = {o.msg.req_id for o in box}
            if not self.waiting <= arrived:
                return False
            for rid in self.waiting:
                out = self.h.take(self.rank, rid)
                assert not isinstance(out.msg, Error), out.msg
            self.waiting = set()
        return True

    def act(self) -> None:
        try:
            what, layer, t = next(self.program)
        except StopIteration:
            self.done = True
            return
        if what in ("fetch", "prefetch"):
            rid = self.prefetched.pop((layer, t), None)
            if rid is None:
                rid = next(self.ids)
                self.h.send(self.rank, Fetch(req_id=rid, layer=layer, min_version=t))
            if what == "prefetch":
                self.prefetched[layer, t] = rid
            else:
                self.waiting = {rid}
        elif what == "push":
            rid = next(self.ids)
            self.pushes.add(rid)
            self.h.push(self.rank, t, layer, grad_of(layer, value(self.rank, t, layer)), rid)
        else:  # drain: every ack of the step
            self.waiting, self.pushes = self.pushes, set()


def run_schedule(h: Harness, steps: int, choices) -> None:
    """Run every rank's program; ``choices`` picks who moves next (or a poll) at each point."""
    workers = [Worker(h, r, steps) for r in range(h.cfg.world_size)]
    choices = iter(choices)
    for _ in range(10_000):
        ready = [w for w in workers if w.runnable()]
        if not ready and all(w.done for w in workers):
            h.poll()  # the last updates
            return
        options = [*ready, None]  # None: deliver the engines' completions
        pick = options[next(choices, 0) % len(options)]
        if pick is None or not ready:
            h.poll()
        else:
            pick.act()
    raise AssertionError("the schedule did not finish: a deadlock")


def final_weights(h: Harness, steps: int) -> list[torch.Tensor]:
    h.hello(0, req_id=5, manifest=None)  # a fresh connection of rank 0 reads the result
    return [h.master(layer, steps) for layer in range(L)]


STEPS = 2


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world_size=st.integers(1, 3), update=st.sampled_from(["eager", "deferred"]),
       optimizer=st.sampled_from(["sgd", "adamw"]), clip=st.sampled_from([0.0, 100.0]),
       choices=st.lists(st.integers(0, 7), max_size=400))
def test_every_interleaving_ends_with_the_same_weights(world_size, update, optimizer, clip,
                                                       choices):
    """``clip`` 100: some steps clip (eager AdamW then guesses, rolls back and holds): the
    schedule still does not change a bit."""
    opt = (OptimizerConfig(name="sgd", lr=0.5, weight_decay=0.0, clip_norm=clip)
           if optimizer == "sgd" else OptimizerConfig(name="adamw", lr=0.01, clip_norm=clip))
    results = []
    for schedule in (choices, []):  # the drawn schedule, and round-robin-by-default
        h = Harness(world_size, optimizer=opt, update=update)
        try:
            h.bootstrap()
            run_schedule(h, STEPS, schedule)
            results.append(final_weights(h, STEPS))
            assert h.core.settled() and h.core.stats.steps_completed == STEPS
        finally:
            h.close()
    for a, b in zip(*results):
        assert torch.equal(a, b)
    if optimizer == "sgd" and not clip:  # and what SGD says: w = 1 - lr * sum of gradients
        for layer, w in enumerate(results[0]):
            total = sum(value(r, t, layer) for r in range(world_size) for t in range(STEPS))
            for v in views(w, LAYOUT.layers[layer]):
                assert torch.equal(v, torch.full_like(v, 1.0 - 0.5 * total))


# ----------------------------------------------------------------------------- semantics


def test_eager_updates_each_layer_as_its_last_gradient_arrives(make):
    """A pushed gradient is held where it lies (no copy, no ack) until every rank's is in;
    the update reads them all, then acknowledges each."""
    h = make(2)
    h.bootstrap()
    h.send(0, Fetch(req_id=7, layer=2, min_version=1))
    h.push(0, 0, 2, grad_of(2, 1.0), 8)
    h.poll()
    assert h.take(0, 8) is None and h.take(0, 7) is None  # both wait for rank 1
    assert h.core.stats.reducing == 1
    h.push(1, 0, 2, grad_of(2, 3.0), 9)
    h.poll()
    assert isinstance(h.take(0, 8).msg, GradAck) and isinstance(h.take(1, 9).msg, GradAck)
    assert h.core.stats.reducing == 0
    ready = h.take(0, 7)
    assert isinstance(ready.msg, LayerReady) and ready.msg.version == 1
    assert h.core.store.versions == [0, 0, 1]
    assert torch.allclose(h.master(2, 1)[:32], torch.full((32,), 1 - 0.5 * 4))


def test_deferred_waits_for_the_step_and_clips_globally(make):
    h = make(1, update="deferred", optimizer=OptimizerConfig(name="sgd", lr=0.1,
                                                             weight_decay=0.0, clip_norm=1.0))
    h.bootstrap()
    values = {2: 3.0, 1: 0.01, 0: 2.0}
    for i, layer in enumerate((2, 1)):
        h.push(0, 0, layer, grad_of(layer, values[layer]), 10 + i)
        h.poll()
    assert h.core.store.versions == [0, 0, 0]  # nothing before the last layer
    h.push(0, 0, 0, grad_of(0, values[0]), 12)
    h.poll()
    assert h.core.store.versions == [1, 1, 1]
    coef = 1.0 / (math.sqrt(sum(40 * v * v for v in values.values())) + 1e-6)
    for layer, v in values.items():
        got = torch.cat([t.reshape(-1) for t in views(h.master(layer, 1), LAYOUT.layers[layer])])
        assert torch.allclose(got, torch.full((40,), 1 - 0.1 * v * coef))


def test_stale_duplicate_and_bad_pushes_change_nothing(make):
    h = make(2)
    h.bootstrap()
    h.push(0, 1, 2, grad_of(2, 1.0), 10)  # a step ahead
    assert error(h.take(0, 10)).field == "step"
    h.push(0, 0, 2, grad_of(2, 1.0), 11)
    h.push(0, 0, 2, grad_of(2, 1.0), 12)  # duplicate while the first is reduced
    assert error(h.take(0, 12)).field == "rank"
    h.send(0, PushGrad(req_id=13, step=0, layer=2, rank=1, slot=-1, dtype="float32"),
           [grad_of(2, 1.0).numpy()])  # another rank's push from this connection
    assert error(h.take(0, 13)).field == "rank"
    bad = grad_of(2, 1.0)
    bad[3] = float("nan")
    h.push(1, 0, 2, bad, 14)
    h.poll()
    assert error(h.take(1, 14)).field == "frames" and h.core.store.versions[2] == 0
    assert h.take(0, 11) is None  # rank 0's part waits for rank 1's again
    h.push(1, 0, 2, grad_of(2, 2.0), 15)  # the refused push may be sent again
    h.poll()
    assert isinstance(h.take(1, 15).msg, GradAck) and h.core.store.versions[2] == 1
    assert isinstance(h.take(0, 11).msg, GradAck)
    h.push(1, 0, 2, grad_of(2, 2.0), 16)  # stale: layer 2 is at version 1 now
    assert error(h.take(1, 16)).field == "step"
    assert torch.allclose(h.master(2, 1)[:32], torch.full((32,), 1 - 0.5 * 3))


def test_fetch_rules(make):
    h = make(1)
    h.send(0, Fetch(req_id=3, layer=0, min_version=0))
    assert error(h.take(0, 3)).code == "not_registered"
    h.bootstrap()
    h.send(0, Fetch(req_id=4, layer=0, min_version=2))
    assert error(h.take(0, 4)).field == "min_version"
    h.send(0, Fetch(req_id=5, layer=9, min_version=0))
    assert error(h.take(0, 5)).field == "layer"
    h.push(0, 0, 1, grad_of(1, 1.0), 6)  # reduced; its update not yet taken in...
    h.send(0, Fetch(req_id=7, layer=1, min_version=0))  # ...version 0 is being replaced
    assert error(h.take(0, 7)).field == "min_version"


# each layer: a trained matrix, then a frozen one (a LoRA layer's shape)
FROZEN = Manifest(layers=tuple(LayerSpec(name=f"l{i}", kind="k", tensors=(
    TensorSpec(name="w", shape=(4, 8)), TensorSpec(name="f", shape=(64, 8), group="frozen")))
    for i in range(L)), meta={"model": "core-test-frozen"})


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_fetch_of_the_trained_part_leaves_the_frozen_tensors_out(make, precision):
    """which="trained": the fp32 master's trainable prefix alone (a LoRA adapter's save need
    not move the frozen base); "master" is the whole layer, its frozen tensors as served."""
    h = make(1, manifest=FROZEN, precision=precision)
    h.bootstrap(value=1.0)
    plan = h.layout.layers[1]
    grad = torch.zeros(plan.trainable)
    views(grad, replace(plan, tensors=plan.tensors[:1]))[0].fill_(1.0)
    h.push(0, 0, 1, grad, 6)
    h.poll()
    whole, trained = h.master(1, 1), h.master(1, 1, which="trained")
    assert whole.numel() == plan.numel and trained.numel() == plan.trainable < plan.numel / 4
    assert torch.equal(trained, whole[:plan.trainable])
    w, f = (whole[s.offset:s.offset + s.numel] for s in plan.tensors)
    assert torch.equal(w, torch.full((32,), 0.5)) and torch.equal(f, torch.ones(512))


def test_frozen_tensors_may_come_in_the_compute_dtype(make):
    """InitLayer's frame: the trainable prefix in fp32, the frozen tail in the compute dtype
    (the only copy the EPS keeps of it), served as sent; another dtype, a frame of the wrong
    size or a non-finite value is refused and initialises nothing."""
    h = make(1, manifest=FROZEN, precision="bf16")
    assert h.hello(0).init_layers == tuple(range(L))
    plan = h.layout.layers[0]
    head = torch.arange(plan.trainable, dtype=torch.float32) / 7
    tail = (torch.arange(plan.numel - plan.trainable) / 3).bfloat16()

    def init(req_id, dtype, *parts):
        h.send(0, InitLayer(req_id=req_id, layer=0, frozen_dtype=dtype),
               [b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in parts)])
        h.poll()
        return h.take(0, req_id)

    assert error(init(1, "float16", head, tail.half())).field == "frozen_dtype"
    assert error(init(2, "bfloat16", head, tail[1:])).field == "frames"
    assert error(init(3, "bfloat16", head, torch.cat([tail[:-1], tail[:1] / 0]))).code \
        == "bad_request"
    assert h.core.store.versions[0] == -1
    assert isinstance(init(4, "bfloat16", head, tail).msg, Ack)
    assert torch.equal(h.master(0, 0), torch.cat([head, tail.float()]))
    served = h.master(0, 0, which="compute").view(torch.bfloat16)
    assert torch.equal(served, torch.cat([head.bfloat16(), tail]))


def test_fp16_compute_refuses_initial_values_it_would_serve_as_inf(make):
    """With fp16 compute a value float16 rounds to inf (|x| >= 65520) is refused with the
    reason, and nothing is initialised; 65519 (served as 65504) is taken. The worker names a
    frozen tensor that overflows before it sends its frame."""
    h = make(1, manifest=FROZEN, precision="fp16")
    h.hello(0)
    plan = h.layout.layers[0]

    def init(req_id, big):
        values = torch.zeros(plan.numel)
        values[3] = big
        h.send(0, InitLayer(req_id=req_id, layer=0), [values.numpy().tobytes()])
        h.poll()
        return h.take(0, req_id)

    refused = error(init(1, -65520.0))
    assert "beyond float16's range" in refused.message and refused.field == "frames"
    assert h.core.store.versions[0] == -1
    assert isinstance(init(2, 65519.0).msg, Ack)
    assert h.core.store.compute(0)[3] == 65504

    class Source:
        def load(self, plan):
            return {"w": torch.ones(4, 8), "f": torch.full((64, 8), 7e4)}

    frame = torch.empty(4 * plan.numel, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"l0\.f \(frozen\).*float16's range"):
        init_frame(Source(), plan, frame, torch.float16)
    init_frame(Source(), plan, frame, torch.bfloat16)  # (bf16 has fp32's range)


def test_save_holds_the_next_step_until_written(make, tmp_path):
    h = make(1)
    h.bootstrap()
    for layer in (2, 1):  # step 0 half done: layers 2, 1 updated, layer 0 not yet pushed
        h.push(0, 0, layer, grad_of(layer, 1.0), 10 + layer)
    h.poll()
    assert h.core.store.versions == [0, 1, 1]
    h.send(0, Save(req_id=20, path=str(tmp_path / "ckpt")))
    h.poll()
    assert h.take(0, 20) is None  # target: step 1, not reached yet
    h.push(0, 0, 0, grad_of(0, 1.0), 21)
    h.poll()  # layer 0 reaches 1: the boundary; the checkpoint is written
    assert isinstance(h.take(0, 20).msg, Ack)
    from protocol.checkpoints import resolve

    state = json.loads(open(os.path.join(resolve(str(tmp_path / "ckpt")),
                                         "state.json")).read())
    assert state["step"] == 1 and state["versions"] == [1, 1, 1]


class FakeEngines:
    """Records the scheduler's jobs instead of running them."""

    def __init__(self):
        self.jobs, self.layers = [], []
        self.boxes = None

    def submit(self, job):
        self.jobs.append(job)

    exclusive = submit


def _parts(layer: int, t: int) -> tuple[Part, ...]:
    return (Part(torch.zeros(1), PushTicket(b"r0", 1, 0, t, layer, 0, False)),)


def _updated(job: Update) -> Done:
    return Done(job, Updated(Checked((), False, 0.0), True, None, 0.0))


def test_a_checkpoint_holds_the_updates_past_its_target():
    """Save while step 1 is under way: the target is the version the updates already sent
    will reach (2); step 1's other updates still run, step 2's wait until it is written."""
    store = SimpleNamespace(versions=[1, 1, 1], num_layers=3, step=1)
    engines = FakeEngines()
    s = UpdateScheduler(ServerConfig(run_id="x"), store, engines, EpsStats(), "x")
    s.reduced(2, 1, _parts(2, 1))  # layer 2's step-1 update is sent: it will reach version 2
    s.request_save("/nowhere", "requester")
    assert [type(j) for j in engines.jobs] == [Update]
    assert engines.jobs[0].action is Action.FINAL
    s.reduced(1, 1, _parts(1, 1))  # step 1 (t < target): not held
    assert [(type(j), j.layer) for j in engines.jobs[1:]] == [(Update, 1)]
    for job in engines.jobs[:2]:  # both updates finish: layers 2 and 1 at version 2
        s.updated(_updated(job))
        assert s.due() == [Publish(job.layer, 2)]
        store.versions[job.layer] = 2
        s.published(job.layer, 2)
        s.boundary()
    s.reduced(2, 2, _parts(2, 2))  # step 2's update of layer 2 would pass the target: held
    assert len(engines.jobs) == 2
    s.reduced(0, 1, _parts(0, 1))
    s.updated(_updated(engines.jobs[2]))
    assert s.due() == [Publish(0, 2)]
    store.versions[0] = 2
    s.published(0, 2)
    s.boundary()  # every layer at the target: the checkpoint is sent, still nothing else
    assert [type(j) for j in engines.jobs[3:]] == [Exclusive]
    assert engines.jobs[3].ticket == SaveTicket("requester", "/nowhere", 2, s.checkpoint_extra())
    saved = s.saved(Done(engines.jobs[3], None))
    assert saved == Saved("requester", "/nowhere", 2)
    assert [(type(j), j.layer, j.t) for j in engines.jobs[4:]] == [(Update, 2, 2)]  # released


def test_set_hyper_applies_from_the_next_update(make):
    h = make(1)
    h.bootstrap()
    h.push(0, 0, 2, grad_of(2, 1.0), 10)
    h.poll()
    h.send(0, SetHyper(req_id=11, changes={"lr": 0.25}))
    assert h.take(0, 11).msg.optimizer["lr"] == 0.25
    h.push(0, 0, 1, grad_of(1, 1.0), 12)
    h.poll()
    assert torch.allclose(h.master(2, 1)[:32], torch.full((32,), 0.5))
    assert torch.allclose(h.master(1, 1)[:32], torch.full((32,), 0.75))
    h.send(0, SetHyper(req_id=13, changes={"name": "adamw"}))
    assert error(h.take(0, 13)).field == "changes"
    for req, typo in enumerate(({"lr": 1e30}, {"warmup_steps": 2**62}), start=14):
        h.send(0, SetHyper(req_id=req, changes=typo))  # refused: a typo, not a setting
        assert "must be in [0, " in error(h.take(0, req)).message
    h.send(0, SetHyper(req_id=16, changes={"clip_norm": 0.0}))  # unchanged by the refusals
    assert h.take(0, 16).msg.optimizer["lr"] == 0.25


def run_steps(h: Harness, grads, dtype=torch.float32, wire="float32") -> list[torch.Tensor]:
    """Push ``grads[t][rank][layer]`` (last layer first, ranks interleaved) step by step; the
    final masters."""
    for t, step in enumerate(grads):
        for layer in reversed(range(L)):
            for rank, per_layer in enumerate(step):
                h.push(rank, t, layer, per_layer[layer].to(dtype), 1000 * t + 10 * layer + rank,
                       dtype=wire)
            h.poll()
        for rank in range(len(step)):
            for layer in range(L):
                assert isinstance(h.take(rank, 1000 * t + 10 * layer + rank).msg, GradAck)
    return [h.master(layer, len(grads)) for layer in range(L)]


def random_grads(steps, world, scales, seed=0):
    """``scales[t]``: one number, or one per layer."""
    g = torch.Generator().manual_seed(seed)
    return [[[torch.randn(LAYOUT.layers[layer].numel, generator=g) * (
        scales[t][layer] if isinstance(scales[t], tuple) else scales[t])
        for layer in range(L)] for _ in range(world)] for t in range(steps)]


@pytest.mark.parametrize("world_size", [1, 3])
def test_eager_global_clipping_equals_deferred(make, world_size):
    """AdamW with --clip-norm: eager updates a layer at once when its gradient and those above
    it are within the clip, and takes back (undoes) and redoes with the global coefficient
    the layers of a step that the layers below then push over it; deferred waits for the
    step. Their weights agree within 1e-5 + 1e-4 relative in steps where clipping fires (0:
    layer 0 pushes it over, layers 2 and 1 were updated; 2: layer 2 alone is over, nothing
    is updated early; 3: layer 1 pushes it over) and where it does not (1, 4, 5)."""
    adamw = OptimizerConfig(name="adamw", lr=0.01, weight_decay=0.1, clip_norm=1.0)
    scales = [(1.0, 0.01, 0.01), 1e-3, 1.0, (1.0, 1.0, 0.01), 1e-3, 1e-3]  # by layer 0, 1, 2
    grads = random_grads(len(scales), world_size, scales)
    got = {}
    for update in ("eager", "deferred"):
        h = make(world_size, optimizer=adamw, update=update)
        h.bootstrap()
        got[update] = run_steps(h, grads)
        s = h.core.stats
        assert s.clipped_steps == 3 and s.overflow_steps == 0
        assert s.rollbacks == (2 + 1 if update == "eager" else 0)
        # one observation of a layer's update time per update, whatever the decision
        assert sum(s.update_latency.counts) == s.updates == len(scales) * L
    for a, b in zip(got["eager"], got["deferred"]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (a - b).abs().max()


def test_eager_fp16_overflow_skips_the_whole_step_as_deferred(make):
    """fp16 with loss scaling and clipping: an overflow in one rank's gradient of the last
    layer pushed (layer 0) skips the whole step; the layers eager updated before it are taken
    back. Two ranks, weights as deferred's within 1e-5 + 1e-4 relative."""
    adamw = OptimizerConfig(name="adamw", lr=0.01, clip_norm=5.0)
    scales = [0.1, 0.1, 3.0, 0.01]  # clean, overflows, clips, clean
    grads = random_grads(len(scales), 2, scales, seed=1)
    grads[1][1][0][7] = math.inf  # step 1, rank 1, layer 0
    got = {}
    for update in ("eager", "deferred"):
        h = make(2, optimizer=adamw, update=update, precision="fp16", loss_scale=1.0)
        h.bootstrap(grad_dtype="compute")
        got[update] = run_steps(h, grads, torch.float16, "float16")
        s = h.core.stats
        assert s.overflow_steps == 1 and s.skipped_updates == L and s.clipped_steps == 1
        assert h.core.scheduler.scaler.scale == 0.5
        # eager updated layers 2 and 1 of step 1 early; layer 0's overflow takes them back
        # (layer 0, not finite, is never written); step 2's layer 2 alone is over the clip
        assert s.rollbacks == (L - 1 if update == "eager" else 0)
        assert sum(s.update_latency.counts) == s.updates == len(scales) * L
    for a, b in zip(got["eager"], got["deferred"]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (a - b).abs().max()


@pytest.mark.parametrize("update", ["eager", "deferred"])
def test_fp16_overflow_skips_and_halves_the_scale(make, update):
    h = make(1, precision="fp16", loss_scale=1024.0, update=update)
    h.bootstrap(grad_dtype="compute")
    bad = grad_of(2, 1.0, torch.float16)
    bad[3] = float("inf")
    h.push(0, 0, 2, bad, 10, dtype="float16")
    h.push(0, 0, 1, grad_of(1, 512.0, torch.float16), 11, dtype="float16")
    h.push(0, 0, 0, grad_of(0, 512.0, torch.float16), 12, dtype="float16")
    h.poll()
    assert all(isinstance(h.take(0, i).msg, GradAck) for i in (10, 11, 12))
    for layer in range(L):  # the whole step is skipped, as torch.amp.GradScaler does
        assert torch.equal(h.master(layer, 1)[:32], torch.ones(32))
    s = h.core.stats
    assert s.overflow_steps == 1 and h.core.scheduler.scaler.scale == 512.0
    assert s.skipped_updates == 3


def test_the_time_the_eps_did_not_run_is_no_peers_silence(make):
    """Stopped for 20 s, the EPS has its peers' heartbeats still unread: they are excused
    that time, and declared dead only after a timeout's silence beyond it."""
    h = make(2, heartbeat_timeout=10.0)
    h.bootstrap()
    h.now = 5.0
    for rank in (0, 1):
        h.send(rank, Heartbeat(req_id=20 + rank))
    h.now = 30.0
    h.core.excuse(20.0)  # as the server's watch finds it late by 20 s
    assert h.core.expire() == []
    h.send(0, Heartbeat(req_id=22))
    h.now = 35.5  # rank 1: 10.5 s of silence beyond the excused time
    assert [p.rank for p in h.core.expire()] == [1]


def test_a_live_rank_is_kept_and_a_silent_one_declared_dead(make):
    h = make(2, heartbeat_timeout=10.0)
    h.bootstrap()
    h.send(1, Fetch(req_id=5, layer=0, min_version=1))
    other = b"rank1-restarted"
    hello = Hello(req_id=7, protocol_version=PROTOCOL_VERSION, rank=1, world_size=2,
                  manifest_hash=MANIFEST.hash(), transport="frames", grad_dtype="float32")
    h.now = 9.0
    h.send(0, Heartbeat(req_id=2))
    h.send(1, hello, peer=other)
    assert error(h.take(1, 7, peer=other)).code == "rank_taken"  # rank 1 is alive
    h.send(1, Heartbeat(req_id=6))
    assert isinstance(h.take(1, 6).msg, Ack)
    h.now = 18.0  # 9 s after its heartbeat: still alive
    h.send(1, hello, peer=other)
    assert error(h.take(1, 7, peer=other)).code == "rank_taken"
    assert h.core.expire() == []
    h.send(0, Heartbeat(req_id=4))  # rank 0 keeps talking
    h.now = 19.5  # 10.5 s of silence: rank 1 is dead, rank 0 is not
    assert [p.rank for p in h.core.expire()] == [1]
    assert h.core.status_stats() and h.take(1, 5) is None  # its Fetch goes to nobody
    h.send(1, Heartbeat(req_id=3))
    assert error(h.take(1, 3)).code == "not_registered"  # a revived one is told
    h.send(1, hello, peer=other)
    welcome = h.take(1, 7, peer=other).msg
    assert welcome.rejoined and welcome.step == 0 and welcome.pushed == ()
    h.send(1, Status(req_id=8), peer=other)
    assert h.take(1, 8, peer=other).msg.ranks == (0, 1)
    h.send(1, Fetch(req_id=9, layer=0, min_version=1), peer=other)
    h.send(1, Bye(req_id=10, rank=1, done=True), peer=other)
    assert error(h.take(1, 9, peer=other)).code == "bad_request"
    assert isinstance(h.take(1, 10, peer=other).msg, Ack)
    assert not h.core.all_done  # rank 0 has not said Bye


def test_the_lobby_answers_until_the_first_hello(make):
    h = make(1)
    h.send(0, Status(req_id=1))
    assert h.take(0, 1).msg.versions == () and h.core is None
    h.send(0, Fetch(req_id=2, layer=0, min_version=0))
    assert error(h.take(0, 2)).code == "not_registered"
    h.send(0, SetHyper(req_id=3, changes={"lr": 0.125}))  # the core will start with it
    assert h.take(0, 3).msg.optimizer["lr"] == 0.125
    assert h.hello(0, req_id=4, manifest=None).code == "not_ready"
    assert h.hello(0, req_id=5, world_size=2).field == "world_size"
    assert h.hello(0, req_id=6, manifest_hash="sha256:0").field == "manifest_hash"
    assert h.core is None
    h.bootstrap()
    assert h.core.cfg.optimizer.lr == 0.125


# ----------------------------------------------------------------------------- engines


class SlowMath:
    """Stands in for a layer's math: a gradient check that takes a while and records when
    (and finds the gradient not finite, so that nothing else runs)."""

    def __init__(self, log, gate=None):
        self.log, self.gate = log, gate

    def check(self, parts):
        (tag,) = parts
        self.log.append(("start", tag))
        if self.gate is not None:
            self.gate.wait(10)
        else:
            time.sleep(0.05)
        self.log.append(("end", tag))
        return Checked((0,), False, math.nan)


def slow_job(layer: int, tag: str) -> Update:
    return Update(layer, 0, (Part(tag, None),), Action.FINAL, 1.0, OptimizerConfig())


def test_engines_park_for_an_exclusive_job():
    """A checkpoint runs while no other engine runs anything: engine 1's queued job finishes
    before it, and engine 1's next job waits until it is done."""
    log, done = [], queue.SimpleQueue()
    engines = Engines(None, [SlowMath(log), SlowMath(log)], 2, done.put)
    try:
        engines.submit(slow_job(1, "before"))
        engines.exclusive(Exclusive(lambda: log.append(("checkpoint", None)), "ckpt", None))
        engines.submit(slow_job(1, "after"))
        for _ in range(3):
            done.get(timeout=10)
        assert log == [("start", "before"), ("end", "before"), ("checkpoint", None),
                       ("start", "after"), ("end", "after")]
    finally:
        engines.close()


def test_engines_stop_while_an_exclusive_job_waits():
    """close() returns even when the engines were parking for a checkpoint that cannot start
    (engine 0 busy): the checkpoint is dropped, nobody stays parked."""
    gate, log = threading.Event(), []
    engines = Engines(None, [SlowMath(log, gate), SlowMath(log)], 2, lambda d: None)
    engines.submit(slow_job(0, "busy"))
    engines.exclusive(Exclusive(lambda: log.append(("checkpoint", None)), "ckpt", None))
    closer = threading.Thread(target=engines.close)
    closer.start()
    time.sleep(0.1)
    gate.set()  # the running job finishes; then the engines stop
    closer.join(10)
    assert not closer.is_alive()
    assert ("checkpoint", None) not in log


@pytest.mark.parametrize("update", ["eager", "deferred"])
def test_a_layer_every_rank_skips_advances_without_an_update(make, update):
    """LayerDrop: when every rank skipped layer 1 its version advances, its weights and
    optimizer state untouched; in deferred mode the step's other layers still update."""
    h = make(2, update=update)
    h.bootstrap()
    h.send(0, PushGrad(req_id=10, step=0, layer=1, rank=0, slot=-1, dtype="float32",
                       skip=True))
    h.push(1, 0, 1, grad_of(1, 1.0), 11)  # rank 1 pushes a gradient instead: refused
    assert error(h.take(1, 11)).field == "skip"
    h.send(1, PushGrad(req_id=12, step=0, layer=1, rank=1, slot=-1, dtype="float32",
                       skip=True))
    for layer in (2, 0):
        for r in (0, 1):
            h.push(r, 0, layer, grad_of(layer, 1.0), 20 + 2 * layer + r)
    h.poll()
    assert isinstance(h.take(0, 10).msg, GradAck) and isinstance(h.take(1, 12).msg, GradAck)
    assert h.core.store.versions == [1, 1, 1]
    assert torch.equal(h.master(1, 1), torch.ones(LAYOUT.layers[1].numel))  # as bootstrapped
    assert torch.allclose(h.master(2, 1)[:32], torch.full((32,), 1 - 0.5 * 2))
    assert h.core.engines.layers[1].optimizer.steps.item() == 0  # its state never moved
    assert h.core.stats.skipped_updates == 0


def test_a_step_0_skip_may_come_before_the_initial_values(make):
    """A worker that is not the initialiser may skip a layer of step 0 (LayerDrop) before the
    initialiser has sent that layer's values: the skip waits, and counts once they are in."""
    h = make(2)
    for r in range(2):
        h.hello(r)
    h.send(1, PushGrad(req_id=11, step=0, layer=1, rank=1, slot=-1, dtype="float32", skip=True))
    assert isinstance(h.take(1, 11).msg, GradAck)
    for plan in LAYOUT.layers:
        h.send(0, InitLayer(req_id=100 + plan.index, layer=plan.index),
               [torch.full((plan.numel,), 1.0).numpy()])
    h.poll()
    h.send(0, PushGrad(req_id=12, step=0, layer=1, rank=0, slot=-1, dtype="float32", skip=True))
    h.poll()
    assert isinstance(h.take(0, 12).msg, GradAck) and h.core.store.versions == [0, 1, 0]


def test_a_skip_may_come_a_step_early(make):
    """A worker skips a layer without fetching it: its skip for step 1 may arrive while the
    layer is still at version 0 (another rank has not pushed step 0 yet); it counts once the
    layer reaches version 1. Two steps ahead is refused."""
    h = make(2)
    h.bootstrap()
    h.push(0, 0, 1, grad_of(1, 1.0), 10)
    h.send(0, PushGrad(req_id=11, step=1, layer=1, rank=0, slot=-1, dtype="float32", skip=True))
    h.send(0, PushGrad(req_id=12, step=2, layer=1, rank=0, slot=-1, dtype="float32", skip=True))
    assert error(h.take(0, 12)).field == "step"
    h.send(0, PushGrad(req_id=13, step=1, layer=1, rank=0, slot=-1, dtype="float32", skip=True))
    assert error(h.take(0, 13)).field == "rank"  # the same early skip twice
    h.push(1, 0, 1, grad_of(1, 1.0), 14)
    h.poll()
    assert isinstance(h.take(0, 11).msg, GradAck) and h.core.store.versions[1] == 1
    h.send(1, PushGrad(req_id=15, step=1, layer=1, rank=1, slot=-1, dtype="float32", skip=True))
    h.poll()
    assert h.core.store.versions[1] == 2
    assert torch.allclose(h.master(1, 2)[:32], torch.full((32,), 1 - 0.5 * 2))  # step 0 only
