"""Layered models, binding, dropout replay and data sharding (in one process)."""

from __future__ import annotations

import pytest
import torch

from protocol.tensors import named_views, plan_layout
from worker.config import ModelConfig
from worker.data import MarkovTask, Sharder, TriggerTask, build_task
from worker.models import build_model
from worker.models.base import dropout_seed, seeded


def cfg(model: str, **kw) -> ModelConfig:
    base = dict(model=model, layers=2, hidden=32, heads=2, seq_len=16, vocab=64, dropout=0.1)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("model", ["bert", "gpt"])
def test_manifest_matches_assembled_state_dict(model):
    m = build_model(cfg(model))
    names = {f"{la.name}.{t.name}": t.shape for la in m.manifest().layers for t in la.tensors}
    sd = m.assemble().state_dict()
    assert names == {k: tuple(v.shape) for k, v in sd.items()}


@pytest.mark.parametrize("model", ["bert", "gpt"])
def test_layer_by_layer_equals_assembled(model):
    """Binding weightless templates to flat weights, layer by layer, with the executor's
    seeding, gives the assembled module's loss and gradients bit for bit."""
    c = cfg(model)
    m = build_model(c)
    layout = plan_layout(m.manifest())
    flats = [m.init_flat(p.index, p) for p in layout.layers]
    batch = Sharder(build_task(build_model(c)), 4, 2).batches(3, [1])[0]

    net = m.assemble().train()
    loss_ref, _ = net(batch, rng=(c.seed, 3, 1))
    loss_ref.backward()
    ref_grads = dict((k, p.grad) for k, p in net.named_parameters())

    x = None
    leaves_all = []
    for plan, flat in zip(layout.layers, flats):
        leaves = {n: v.requires_grad_() for n, v in named_views(flat, plan).items()}
        leaves_all.append((plan, leaves))
        stage = m.template(plan.kind).bind(leaves)
        with seeded(dropout_seed(c.seed, 3, plan.index, 1), torch.device("cpu")):
            x = stage(x, batch)
    loss, _ = x
    loss.backward()
    assert torch.equal(loss, loss_ref)
    for plan, leaves in leaves_all:
        for name, leaf in leaves.items():
            assert torch.equal(leaf.grad, ref_grads[f"{plan.name}.{name}"]), name


def test_templates_own_no_memory():
    m = build_model(cfg("bert", hidden=128))
    for kind in ("embed", "encoder", "classifier"):
        assert all(p.device.type == "meta" for p in m.template(kind).module.parameters())


def test_dropout_replay_is_order_independent():
    c = cfg("bert", dropout=0.5)
    m = build_model(c)
    plan = plan_layout(m.manifest()).layers[1]
    stage = m.template(plan.kind).bind(named_views(m.init_flat(1, plan), plan))
    x = torch.randn(2, 16, 32)
    outs = {}
    for mb in (0, 1, 0):  # interleaving other draws must not change a micro-batch's masks
        with seeded(dropout_seed(c.seed, 0, 1, mb), torch.device("cpu")):
            outs.setdefault(mb, []).append(stage(x, None))
        torch.rand(100)
    assert torch.equal(outs[0][0], outs[0][1])
    assert not torch.equal(outs[0][0], outs[1][0])


def test_init_is_a_pure_function_of_seed_and_layer():
    a = build_model(cfg("gpt", layers=4))
    b = build_model(cfg("gpt", layers=2))
    plan_a = plan_layout(a.manifest()).layers
    plan_b = plan_layout(b.manifest()).layers
    assert torch.equal(a.init_flat(1, plan_a[1]), b.init_flat(1, plan_b[1]))
    assert not torch.equal(a.init_flat(1, plan_a[1]), a.init_flat(2, plan_a[2]))


@pytest.mark.parametrize("model", ["bert", "gpt"])
def test_sharding_two_by_two_equals_one_by_four(model):
    c = cfg(model)
    task = build_task(build_model(c))
    one = Sharder(task, 4, 4).batches(7, range(4))
    two = Sharder(task, 4, 4).batches(7, range(0, 2)) + Sharder(task, 4, 4).batches(7, range(2, 4))
    for a, b in zip(one, two):
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
        assert a.norm == b.norm
    assert not torch.equal(one[0].inputs, Sharder(task, 4, 4).batches(8, [0])[0].inputs)


def test_trigger_task_labels_follow_the_planted_rule():
    c = cfg("bert", classes=4)
    task = TriggerTask(c)
    b = task.micro_batch(0, 0, 64, 64.0)
    assert (b.inputs[:, 0] == task.cls_token).all()
    for ids, label in zip(b.inputs, b.targets):
        triggers = ids[(ids < task.first_neutral)]
        assert len(triggers) >= 1
        assert ((triggers // task.k) == label).all()


def test_markov_task_follows_the_chain():
    c = cfg("gpt")
    task = MarkovTask(c)
    b = task.micro_batch(0, 0, 8, 8.0)
    for row in b.inputs:
        for a, nxt in zip(row[:-1], row[1:]):
            assert nxt in task.succ[a]
    assert 0 < task.entropy < torch.log(torch.tensor(4.0))
