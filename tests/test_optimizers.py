"""The EPS's per-layer optimizers against torch and against the papers' equations; schedules
and clipping against their definitions (in one process, on flat layer buffers)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eps_server import lamb_kernels
from eps_server.config import OptimizerConfig
from eps_server.optimizers import make_optimizer
from eps_server.schedules import lr_at
from protocol.tensors import LayerSpec, Manifest, TensorSpec, plan_layout, views

torch.manual_seed(0)
LAYER = LayerSpec(name="l", kind="k", tensors=(
    TensorSpec(name="w1", shape=(33, 17)), TensorSpec(name="b1", shape=(17,), group="no_decay"),
    TensorSpec(name="w2", shape=(17, 5)), TensorSpec(name="ln", shape=(5,), group="no_decay")))
PLAN = plan_layout(Manifest(layers=(LAYER,))).layers[0]


def flat_layer(compute_dtype=None):
    """A layer with weights of a trained model's magnitude (fp32 rounding stays far below the
    1e-6 tolerance of the comparisons)."""
    master = torch.zeros(PLAN.numel)
    for v in views(master, PLAN):
        v.copy_(torch.randn(v.shape) * 0.1)
    grad = torch.zeros(PLAN.numel)
    compute = None if compute_dtype is None else torch.zeros(PLAN.numel, dtype=compute_dtype)
    return master, grad, compute


def set_grad(grad, grads):
    for v, g in zip(views(grad, PLAN), grads):
        v.copy_(g)


def torch_params(master):
    return [v.clone().requires_grad_() for v in views(master, PLAN)]


def groups(params, wd):
    decay = [p for p, s in zip(params, PLAN.tensors) if s.group == "decay"]
    no_decay = [p for p, s in zip(params, PLAN.tensors) if s.group == "no_decay"]
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def random_grads():
    return [torch.randn(s.shape) for s in PLAN.tensors]


def assert_matches(master, params, atol):
    for v, p in zip(views(master, PLAN), params):
        assert torch.allclose(v, p.detach(), atol=atol, rtol=0), (v - p).abs().max()


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_matches_torch(name):
    cfg = OptimizerConfig(name=name, lr=1e-2, weight_decay=0.1, momentum=0.9)
    master, grad, _ = flat_layer()
    params = torch_params(master)
    ours = make_optimizer(PLAN, master, None, cfg)
    ref = (torch.optim.AdamW(groups(params, 0.1), lr=1e-2, foreach=False) if name == "adamw"
           else torch.optim.SGD(groups(params, 0.1), lr=1e-2, momentum=0.9, foreach=False))
    for t in range(6):
        g = random_grads()
        set_grad(grad, g)
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        ours.step((grad,), t, lr=1e-2)
        ref.step()
    assert_matches(master, params, 1e-6)
    padding = torch.ones(PLAN.numel, dtype=torch.bool)
    for s in PLAN.tensors:
        padding[s.offset:s.offset + s.numel] = False
    assert (master[padding] == 0).all()  # alignment padding stays zero


def lamb_reference(params, grads_seq, lr, b1, b2, eps, wd_of):
    """LAMB (You et al., 2020, Algorithm 2), per tensor, in float64:
    m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  m^ = m/(1-b1^t);  v^ = v/(1-b2^t)
    r = m^ / (sqrt(v^) + eps) + wd x;  x -= lr * (||x|| / ||r||) * r   (ratio 1 if a norm is 0)"""
    xs = [p.double().clone() for p in params]
    ms = [torch.zeros_like(x) for x in xs]
    vs = [torch.zeros_like(x) for x in xs]
    for t, grads in enumerate(grads_seq, start=1):
        for i, (x, g) in enumerate(zip(xs, grads)):
            g = g.double()
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            m_hat = ms[i] / (1 - b1 ** t)
            v_hat = vs[i] / (1 - b2 ** t)
            r = m_hat / (v_hat.sqrt() + eps) + wd_of[i] * x
            xn, rn = x.norm(), r.norm()
            ratio = xn / rn if xn > 0 and rn > 0 else 1.0
            xs[i] = x - lr * ratio * r
    return xs


@pytest.mark.parametrize("kernels", [True, False], ids=["numba", "torch-fallback"])
def test_lamb_matches_the_paper(kernels, monkeypatch):
    if not kernels:
        monkeypatch.setattr(lamb_kernels, "available", lambda: False)
    cfg = OptimizerConfig(name="lamb", lr=1e-2, weight_decay=0.01, beta1=0.9, beta2=0.999,
                          eps=1e-6)
    master, grad, _ = flat_layer()
    views(master, PLAN)[3].zero_()  # a zero tensor: trust ratio 1
    start = [v.clone() for v in views(master, PLAN)]
    ours = make_optimizer(PLAN, master, None, cfg)
    seq = [random_grads() for _ in range(5)]
    for t, g in enumerate(seq):
        set_grad(grad, g)
        ours.step((grad,), t, lr=cfg.lr)
    wd = [0.01 if s.group == "decay" else 0.0 for s in PLAN.tensors]
    want = lamb_reference(start, seq, cfg.lr, 0.9, 0.999, 1e-6, wd)
    for v, w in zip(views(master, PLAN), want):
        assert torch.allclose(v.double(), w, atol=1e-6, rtol=0), (v.double() - w).abs().max()


@pytest.mark.parametrize("name", ["lamb", "adamw"])
def test_pieces_on_several_threads_give_the_same_bits(name, monkeypatch):
    """A layer cut at block boundaries (inside tensors too) and run on four pool threads ends
    with the bits of one piece on the caller's thread: element-wise passes do not care, and
    LAMB's block sums are kept and added in order (lamb_kernels)."""
    from eps_server import optimizers, pool

    sizes = (10000, 5000, 7, 30000)  # 14 blocks of 4096
    plan = plan_layout(Manifest(layers=(LayerSpec(name="l", kind="k", tensors=tuple(
        TensorSpec(name=f"t{i}", shape=(n,), group="decay" if i % 2 else "no_decay")
        for i, n in enumerate(sizes))),))).layers[0]
    cfg = OptimizerConfig(name=name, lr=1e-2, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    start = torch.randn(plan.numel, generator=g) * 0.1
    grads = [torch.randn(plan.numel, generator=g) * 1e-2 for _ in range(3)]
    runs = []
    for threads in (1, 4):
        piece = 8192 if threads > 1 else 1 << 30
        monkeypatch.setattr(optimizers, "PIECE_ELEMENTS", piece)
        monkeypatch.setattr(pool, "PIECE", piece)
        math_pool = pool.MathPool(threads, inline=threads == 1)
        try:
            opt = make_optimizer(plan, start.clone(), None, cfg, pool=math_pool)
            for t, gr in enumerate(grads):
                opt.step((gr,), t, lr=cfg.lr)
        finally:
            math_pool.close()
        runs.append((opt.master, opt.exp_avg, opt.exp_avg_sq))
    (a, am, av), (b, bm, bv) = runs
    assert torch.equal(a, b) and torch.equal(am, bm) and torch.equal(av, bv)
    assert not torch.equal(a, start)


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(0, 20000), min_size=1, max_size=6), k=st.integers(1, 8))
def test_lamb_pieces_cover_every_element_once_at_block_boundaries(sizes, k):
    starts = np.cumsum([0, *sizes[:-1]]).astype(np.int64)
    ends = starts + np.array(sizes, dtype=np.int64)
    first, count = lamb_kernels.blocks(starts, ends)
    pieces = lamb_kernels.split(starts, ends, k)
    assert len(pieces) <= k
    covered = np.zeros(int(ends[-1]), dtype=np.int64)
    for seg_starts, seg_ends, tensor, block in pieces:
        for s, e, t, b in zip(seg_starts, seg_ends, tensor, block):
            assert starts[t] <= s < e <= ends[t]
            assert s - starts[t] == (b - first[t]) * lamb_kernels.BLOCK
            covered[s:e] += 1
    assert (covered == 1).all()


@pytest.mark.parametrize("name", ["adamw", "lamb", "sgd"])
def test_grad_scale_unscales(name):
    """Stepping on S*g with grad_scale S equals stepping on g (loss scaling, clipping)."""
    cfg = OptimizerConfig(name=name, lr=1e-2, momentum=0.9)
    a_master, a_grad, _ = flat_layer()
    b_master, b_grad = a_master.clone(), a_grad.clone()
    a = make_optimizer(PLAN, a_master, None, cfg)
    b = make_optimizer(PLAN, b_master, None, cfg)
    for t in range(3):
        g = random_grads()
        set_grad(a_grad, g)
        set_grad(b_grad, [x * 1024.0 for x in g])
        a.step((a_grad,), t, lr=1e-2)
        b.step((b_grad,), t, lr=1e-2, grad_scale=1024.0)
    assert torch.allclose(a_master, b_master, atol=1e-6)


@pytest.mark.parametrize("name", ["adamw", "lamb", "sgd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compute_copy_is_written_with_the_update(name, dtype):
    cfg = OptimizerConfig(name=name, lr=1e-2)
    master, grad, compute = flat_layer(dtype)
    opt = make_optimizer(PLAN, master, compute, cfg)
    set_grad(grad, random_grads())
    opt.step((grad,), 0, lr=1e-2)
    assert torch.equal(compute, master.to(dtype))


@pytest.mark.parametrize("dtypes", [(torch.bfloat16,), (torch.float32, torch.bfloat16),
                                    (torch.float16, torch.float32, torch.float16)])
def test_the_ranks_parts_are_summed_in_fp32_in_rank_order(dtypes):
    """The update reads every rank's pushed gradient where it lies (any mix of dtypes) and
    steps on their fp32 sum: the same bits as stepping on that sum made beforehand."""
    cfg = OptimizerConfig(name="adamw", lr=1e-2)
    a_master, _, a_c = flat_layer(torch.bfloat16)
    b_master = a_master.clone()
    a = make_optimizer(PLAN, a_master, a_c, cfg)
    b = make_optimizer(PLAN, b_master, None, cfg)
    for t in range(3):
        parts = [torch.randn(PLAN.numel).to(d) for d in dtypes]
        total = parts[0].float()
        for p in parts[1:]:
            total = total + p.float()
        a.step(tuple(parts), t, lr=1e-2)
        b.step((total,), t, lr=1e-2)
    assert torch.equal(a_master, b_master) and torch.equal(a_c, a_master.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adamw_undo_returns_to_the_state_before_the_step(dtype):
    """Speculative updates are taken back with ``undo`` (the step's kept gradient): the state
    comes back to the rounding of the step's own terms (m, v: a few fp32 ulps of what the
    step added; exactly zero moments after a first step; p: an ulp or two), and a redo with
    another gradient scale lands where that step alone would have, within the equivalence
    tolerance (1e-5 + 1e-4 relative)."""
    cfg = OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.1)
    master, _, compute = flat_layer(torch.bfloat16)
    opt = make_optimizer(PLAN, master, compute, cfg)
    twin = make_optimizer(PLAN, master.clone(), None, cfg)
    ulp = 2.0 ** -23
    for t in range(4):
        g = (torch.randn(PLAN.numel) * 10).to(dtype)
        p0, m0, v0 = (x.clone() for x in (opt.master, opt.exp_avg, opt.exp_avg_sq))
        kept = torch.empty(PLAN.numel, dtype=dtype)
        opt.step((g,), t, lr=1e-2, keep=kept)  # speculative: no clipping
        assert torch.equal(kept, g)
        opt.undo(kept, t, lr=1e-2)
        if t == 0:
            assert not opt.exp_avg.any() and not opt.exp_avg_sq.any()
        gf = g.float()
        assert ((opt.master - p0).abs() <= 4 * ulp * p0.abs() + 1e-9).all()
        assert ((opt.exp_avg - m0).abs() <= 4 * ulp * (m0.abs() + 0.1 * gf.abs())).all()
        assert ((opt.exp_avg_sq - v0).abs() <= 4 * ulp * (v0 + 1e-3 * gf * gf)).all()
        assert torch.equal(compute, opt.master.bfloat16())
        opt.step((kept,), t, lr=1e-2, grad_scale=4.0)  # redone, clipped by 1/4
        twin.step((g,), t, lr=1e-2, grad_scale=4.0)
        assert float(opt.steps) == float(twin.steps) == t + 1
        assert torch.allclose(opt.master, twin.master, rtol=1e-4, atol=1e-5)


def test_bf16_moments_follow_fp32_ones():
    """bf16 moments (stochastic rounding) keep following the gradient where round-to-nearest
    would freeze v (beta2 = 0.999 changes it by 0.1%, below half a bf16 ulp): after 300 steps
    the weights are within a small fraction of the update size of the fp32-state run, the
    rounding noise averaging out, and a run repeats bit for bit."""
    torch.manual_seed(3)
    runs = []
    for states in ("fp32", "bf16", "bf16"):
        cfg = OptimizerConfig(name="adamw", lr=1e-3, weight_decay=0.0, states=states)
        master = torch.zeros(PLAN.numel)
        opt = make_optimizer(PLAN, master, None, cfg)
        g = torch.Generator().manual_seed(0)
        for t in range(300):
            grad = torch.randn(PLAN.numel, generator=g) * 0.1 + 0.05
            opt.step((grad,), t, lr=1e-3)
        runs.append((master, opt.exp_avg_sq.float()))
    (m32, v32), (m16, v16), (again, _) = runs
    assert opt.exp_avg.dtype == torch.bfloat16 and torch.equal(m16, again)
    moved = m32.abs().mean()
    assert (m16 - m32).abs().mean() < 0.02 * moved, ((m16 - m32).abs().mean(), moved)
    assert torch.allclose(v16.mean(), v32.mean(), rtol=0.02)


def test_state_round_trip():
    cfg = OptimizerConfig(name="adamw", lr=1e-2)
    master, grad, _ = flat_layer()
    opt = make_optimizer(PLAN, master, None, cfg)
    set_grad(grad, random_grads())
    opt.step((grad,), 0, lr=1e-2)
    state = {k: v.clone() for k, v in opt.state_tensors().items()}
    m2 = master.clone()
    twin = make_optimizer(PLAN, m2, None, cfg)
    twin.load_state_tensors(state)
    opt.step((grad,), 1, lr=1e-2)
    twin.step((grad,), 1, lr=1e-2)
    assert torch.equal(master, m2)
    compact = make_optimizer(PLAN, master.clone(), None, OptimizerConfig(name="adamw",
                                                                         states="bf16"))
    compact.load_state_tensors(state)  # fp32 moments into bf16 ones: rounded to nearest
    assert torch.equal(compact.exp_avg, state["exp_avg"].bfloat16())


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_schedules_follow_their_definition(schedule):
    lr, w, total, m = 1.0, 10, 110, 0.1
    got = [lr_at(t, lr, schedule, w, total, m) for t in range(130)]
    assert got[:w] == pytest.approx([(t + 1) / w for t in range(w)])  # warmup, never 0
    for t in range(w, 130):
        p = min(1.0, (t - w) / (total - w))
        want = {"constant": 1.0, "linear": m + (1 - m) * (1 - p),
                "cosine": m + (1 - m) * 0.5 * (1 + math.cos(math.pi * p))}[schedule]
        assert got[t] == pytest.approx(want)
    if schedule != "constant":
        assert got[total] == pytest.approx(m) and got[-1] == pytest.approx(m)
