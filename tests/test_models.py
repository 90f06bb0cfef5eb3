"""Layered models, binding, dropout replay and data sharding (in one process)."""

from __future__ import annotations

import numpy as np
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


def test_manifests_and_templates_skip_initialisers_on_meta():
    """Building a manifest or a template runs no initialiser on the meta device (some go
    through Python references whose first use imports torch._dynamo: seconds a process), and
    initialisers on real tensors still run, also inside the mode."""
    import subprocess
    import sys

    from worker.models.base import SkipInitOnMeta

    code = ("import sys; from worker.config import ModelConfig; "
            "from worker.models import build_model\n"
            "for name in ('bert', 'gpt'):\n"
            "    m = build_model(ModelConfig(model=name, layers=2, hidden=32, heads=2, "
            "seq_len=16, vocab=64))\n"
            "    m.manifest(); [m.template(k) for _, k in m.layer_kinds()]\n"
            "print('torch._dynamo' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["False"], r.stdout + r.stderr
    with SkipInitOnMeta():
        real = torch.nn.init.normal_(torch.zeros(1000), std=1.0)
        real.mul_(2)
    assert real.std() > 1.5


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


def test_markov_task_walks_with_the_chains_probabilities():
    """Each successor is taken as often as its probability says: every token's observed
    transition frequencies within 5 standard errors of its row (32k transitions)."""
    task = MarkovTask(cfg("gpt", vocab=64, seq_len=513))
    seq = torch.cat([task.micro_batch(0, i, 16, 16.0).inputs for i in range(4)])
    counts = torch.zeros(64, 4, dtype=torch.float64)
    for a, b in zip(seq[:, :-1].reshape(-1).tolist(), seq[:, 1:].reshape(-1).tolist()):
        counts[a, task.succ[a].tolist().index(b)] += 1
    visits = counts.sum(1, keepdim=True)
    seen = visits.squeeze(1) >= 100
    assert seen.sum() >= 32
    p = task.probs.double()[seen]
    freq = (counts / visits.clamp(min=1))[seen]
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / visits[seen]).sqrt() + 1e-9).all()
    again = task.micro_batch(0, 3, 16, 16.0).inputs  # a pure function of (step, index)
    assert torch.equal(again, seq[48:])


def test_the_compiled_markov_walk_takes_the_same_steps(monkeypatch):
    """A large micro-batch's walk is compiled (numba): the same tokens as numpy's walk, on
    draws that include values equal to a cumulative bound (the comparison's edge)."""
    from worker.data import synthetic

    compiled = synthetic.compiled_walk()
    if compiled is None:
        pytest.skip("numba is not installed")
    task = MarkovTask(cfg("gpt", vocab=64, seq_len=257))
    rng = np.random.default_rng(0)
    first = rng.integers(0, 64, 32)
    draws = rng.random((256, 32, 1)).astype(np.float32)
    draws[::7, ::3, 0] = task._bounds[rng.integers(0, 64, (37, 11)), 1]  # ties
    a, b = np.empty((257, 32), np.int64), np.empty((257, 32), np.int64)
    synthetic.numpy_walk(first, draws, task._succ, task._bounds, a)
    compiled(first, draws, task._succ, task._bounds, b)
    assert np.array_equal(a, b)
    small = task.micro_batch(2, 1, 16, 1.0).inputs  # 16 x 257 < COMPILED_WALK: numpy
    monkeypatch.setattr(synthetic, "COMPILED_WALK", 1)
    assert torch.equal(task.micro_batch(2, 1, 16, 1.0).inputs, small)
    monkeypatch.setattr(synthetic, "numpy_walk", None)  # the compiled walk alone
    assert torch.equal(task.micro_batch(2, 1, 16, 1.0).inputs, small)


def test_markov_task_entropy_rate_and_successors():
    """Each token's successors are distinct; the entropy rate from the sparse transitions is
    the one of the dense v x v chain (the sparse form lets a 32k vocabulary start at once)."""
    task = MarkovTask(cfg("gpt", vocab=64))
    assert all(len(set(row)) == 4 for row in task.succ.tolist())
    trans = torch.zeros(64, 64, dtype=torch.float64)
    trans.scatter_add_(1, task.succ, task.probs.double())
    pi = torch.full((64,), 1 / 64, dtype=torch.float64)
    for _ in range(500):
        pi = pi @ trans
    assert torch.allclose(pi @ trans, pi, rtol=0, atol=1e-8)  # stationary
    rows = -(task.probs.double() * task.probs.double().log()).sum(-1)
    assert task.entropy == pytest.approx(float(pi @ rows), rel=1e-12)


# ----------------------------------------------------------------------------- the contract


def test_tied_tensor_is_stored_once():
    m = build_model(cfg("gpt", tie_embeddings=True))
    manifest = m.manifest()
    post = manifest.layers[-1]
    assert {t.name: t.tie for t in post.tensors}["out.weight"] == ("pre", "tok.weight")
    assert manifest.hash() != build_model(cfg("gpt")).manifest().hash()
    plan = plan_layout(manifest).layers[-1]
    assert "out.weight" not in {s.name for s in plan.tensors}
    assert [(t.name, t.owner, t.tensor) for t in plan.ties] == [("out.weight", 0, "tok.weight")]
    untied = build_model(cfg("gpt")).manifest()
    assert manifest.num_params == untied.num_params - 64 * 32  # the head's matrix is gone
    net = m.assemble()
    assert net.post.out.weight is net.pre.tok.weight


@pytest.mark.parametrize("tie", [("pre", "nope"), ("post", "w"), ("blocks.0", "w")])
def test_bad_ties_are_refused(tie):
    """A tie names an earlier layer's own tensor of the same shape."""
    from protocol.tensors import LayerSpec, Manifest, TensorSpec

    def layer(name, *tensors):
        return LayerSpec(name=name, kind="k", tensors=tensors)

    with pytest.raises(ValueError, match="no tensor|not an earlier layer"):
        Manifest(layers=(layer("pre", TensorSpec(name="w", shape=(4, 4))),
                         layer("blocks.0", TensorSpec(name="w", shape=(4, 4)),
                               TensorSpec(name="t", shape=(4, 4), tie=tie)),
                         layer("post", TensorSpec(name="w", shape=(4, 4)))))


def test_binding_is_by_name():
    m = build_model(cfg("bert"))
    plan = plan_layout(m.manifest()).layers[1]
    named = named_views(m.init_flat(1, plan), plan)
    binder = m.template(plan.kind)
    stage = binder.bind(dict(reversed(list(named.items()))))  # order does not matter
    assert stage.attn.qkv.weight is named["attn.qkv.weight"]
    with pytest.raises(ValueError, match="missing"):
        binder.bind({k: v for k, v in named.items() if k != "norm1.bias"})


@pytest.mark.parametrize("model", ["gpt-tied", "tests.toy_model:GatedModel",
                                   "tests.toy_model:SharedEmbeddingModel"])
def test_l2l_loop_equals_plain_training_for_ties_and_tuple_boundaries(model):
    """The executor (weights local, per-layer AdamW) trains a GPT whose head is tied to its
    embedding, a model whose boundary is a tuple with an integer member and whose head reads
    the embedding, and one whose every block reads it too (the kept last block among them),
    exactly as plain PyTorch trains the assembled model (dropout on)."""
    from .baseline import assert_close, train_local_l2l, train_resident

    c = (cfg("gpt", tie_embeddings=True) if model == "gpt-tied"
         else cfg(model, dropout=0.2, layers=3))
    got = train_local_l2l(c, steps=3, micro_batches=2, batch_size=4)
    want = train_resident(c, steps=3, global_micro_batches=2, batch_size=4)
    assert_close(got, want)


def test_a_task_must_match_the_models_head():
    from worker.config import DataConfig

    with pytest.raises(ValueError, match="markov"):
        build_task(build_model(cfg("bert")), DataConfig(task="markov"))
    assert isinstance(build_task(build_model(cfg("gpt")), DataConfig(task="auto")), MarkovTask)


def test_initial_weights_from_a_safetensors_file(tmp_path):
    from safetensors.torch import save_file

    net = build_model(cfg("bert", seed=3)).assemble()
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, tmp_path / "m.st")
    m = build_model(cfg("bert", init_from=str(tmp_path / "m.st")))
    assert m.manifest().hash() == build_model(cfg("bert")).manifest().hash()
    for plan in plan_layout(m.manifest()).layers:
        for name, v in named_views(m.init_flat(plan.index, plan), plan).items():
            assert torch.equal(v, net.state_dict()[f"{plan.name}.{name}"])
    sd = net.state_dict()
    del sd["blocks.1.mlp.fc.weight"]
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "short.st")
    short = build_model(cfg("bert", init_from=str(tmp_path / "short.st")))
    with pytest.raises(ValueError, match="blocks.1.mlp.fc.weight"):
        short.init_flat(2, plan_layout(short.manifest()).layers[2])


def test_layer_drop_equals_a_resident_model_skipping_the_same_blocks():
    """LayerDrop: the blocks a step skips are a pure function of (seed, step); a skipped
    block passes its input through and its weights and optimizer state stay as they are, as in
    a resident model that leaves the same blocks out (their parameters get no gradient)."""
    from worker.executor import layer_drop

    from .baseline import assert_close, train_local_l2l, train_resident

    for p in (0.5, 0.9):  # 0.9: some steps skip every block (the head then prefetches pre)
        c = cfg("gpt", layers=4)
        skips = {step: frozenset(layer_drop(c.seed, step, 6, p)) for step in range(4)}
        assert any(skips.values()) and len(set(skips.values())) > 1  # they vary by step
        got = train_local_l2l(c, steps=4, micro_batches=2, batch_size=4, layer_drop=p)
        want = train_resident(c, steps=4, global_micro_batches=2, batch_size=4,
                              skips=lambda step: skips[step])
        assert_close(got, want)
    assert any(len(s) == 4 for s in skips.values())


def test_your_model_is_imported_from_the_working_directory_by_every_program(tmp_path):
    """l2l-launch's children run as python -m (the working directory on sys.path) and found
    ``mypkg.toy:GatedModel``; l2l-export and l2l-worker, console scripts, did not."""
    import shutil
    import subprocess
    import sys

    from .helpers import ENV, ROOT

    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    shutil.copy(ROOT / "tests" / "toy_model.py", tmp_path / "mypkg" / "toy.py")
    script = tmp_path / "bin" / "program.py"  # as a console script: its own folder on the path
    script.parent.mkdir()
    script.write_text("from worker.models import model_class\n"
                      "print(model_class('mypkg.toy:GatedModel').__name__)\n")
    env = dict(ENV, PYTHONPATH=str(ROOT))  # (an empty entry would stand for the cwd)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "GatedModel", out.stderr
