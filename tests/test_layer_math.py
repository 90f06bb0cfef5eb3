"""The work around an EPS update (in one process, no sockets): finiteness of a pushed gradient
and of a sum, the layer's gradient norm, and the reduction into the accumulator, with NaN/inf
anywhere, values whose sum or squares overflow, and every gradient dtype; the engines' shared
intra-op threads."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eps_server.config import OptimizerConfig
from eps_server.engines import CHUNK, Engines, LayerMath, Reduced, all_finite, norm2
from eps_server.optimizers import make_optimizer
from eps_server.threads import MAX_ENGINES, ThreadBudget, rebalance
from protocol.tensors import LayerSpec, Manifest, TensorSpec, plan_layout

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# More than two chunks, not a multiple of one: the reduction's chunk loop has a ragged end.
N = 2 * CHUNK + 1000
PLAN = plan_layout(Manifest(layers=(LayerSpec(name="l", kind="k", tensors=(
    TensorSpec(name="w", shape=(N,)),)),))).layers[0]


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES), bad=st.sampled_from([math.nan, math.inf, -math.inf]),
       size=st.integers(1, 5000), where=st.floats(0, 1, exclude_max=True),
       threads=st.sampled_from([1, 2]))
def test_one_non_finite_element_anywhere_is_found(dtype, bad, size, where, threads):
    t = torch.randn(size).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # a parallel min/max must still propagate NaN
    try:
        assert all_finite(t)
        t[int(where * size)] = bad
        assert not all_finite(t)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_parallel_min_max_finds_a_non_finite_element_in_any_part(dtype, bad):
    """Large enough that torch splits the reduction over threads (from 32K elements)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        t = torch.randn(N).to(dtype)
        assert all_finite(t)
        for where in (0, CHUNK - 1, CHUNK, N // 2 + 3, N - 1):
            t[where] = bad
            assert not all_finite(t), where
            assert not all_finite(t[1:]) or where == 0  # an offset view as well
            t[where] = 0.5
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_largest_finite_values_are_finite(dtype):
    """Their sum overflows in every float type: a check by summing would call them infinite."""
    big = torch.finfo(dtype).max
    assert all_finite(torch.full((N,), big, dtype=dtype))
    assert all_finite(torch.tensor([big, -big], dtype=dtype))
    assert all_finite(torch.empty(0, dtype=dtype))


def test_the_norm_equals_the_float64_norm_and_survives_squares_beyond_fp32():
    g = torch.randn(N, generator=torch.Generator().manual_seed(0)) * 1e-3
    # 5e-9 typical, 2.2e-8 the worst of 200 draws (one fp32 norm of the whole: ~1e-4)
    assert norm2(g) == pytest.approx(float(torch.linalg.vector_norm(g.double())), rel=1e-7)
    assert norm2(g[:100]) == pytest.approx(float(torch.linalg.vector_norm(g[:100].double())),
                                           rel=1e-7)  # shorter than a row
    huge = torch.full((N,), 1e30)  # squares are 1e60, far beyond fp32: finite in float64
    assert norm2(huge) == pytest.approx(float(huge[0]) * math.sqrt(N), rel=1e-9)
    tiny = torch.full((N,), 1e-25)  # squares underflow fp32: the float64 norm instead
    assert norm2(tiny) == pytest.approx(float(tiny[0]) * math.sqrt(N), rel=1e-9)
    assert norm2(torch.zeros(N)) == 0.0
    for bad in (math.nan, math.inf):
        g[N // 2] = bad
        assert not math.isfinite(norm2(g))


def layer_math() -> LayerMath:
    cfg = OptimizerConfig(name="sgd", lr=0.1, weight_decay=0.0)
    return LayerMath(make_optimizer(PLAN, torch.zeros(N), torch.zeros(N), None, cfg),
                     torch.zeros(N))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("check", [True, False])
def test_gradients_are_summed_exactly_as_fp32(dtype, check):
    parts = [torch.randn(N).to(dtype) for _ in range(3)]
    m = layer_math()
    for p in parts:
        assert m.reduce(p, check_finite=check) == Reduced.OK
    expect = parts[0].float() + parts[1].float() + parts[2].float()
    assert torch.equal(m.grad, expect) and m.added == 3


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_non_finite_gradient_is_refused_and_adds_nothing(dtype):
    m = layer_math()
    first = torch.randn(N).to(dtype)
    assert m.reduce(first, check_finite=True) == Reduced.OK
    bad = torch.randn(N).to(dtype)
    bad[N - 1] = math.inf  # in the last, short chunk
    assert m.reduce(bad, check_finite=True) == Reduced.REFUSED
    assert torch.equal(m.grad, first.float()) and m.added == 1
    fresh = layer_math()
    assert fresh.reduce(bad, check_finite=True) == Reduced.REFUSED and fresh.added == 0


def test_a_gradient_of_another_size_is_an_error_not_a_broadcast():
    m = layer_math()
    m.reduce(torch.ones(N), check_finite=False)
    for size in (N - CHUNK - 999, N + 1):  # the first would leave one element in a chunk
        with pytest.raises(ValueError, match="elements"):
            m.reduce(torch.ones(size), check_finite=False)
    assert torch.equal(m.grad, torch.ones(N)) and m.added == 1


def test_finite_gradients_whose_sum_overflows_are_an_overflow():
    m = layer_math()
    big = torch.zeros(N)
    big[CHUNK + 7] = torch.finfo(torch.float32).max  # in the middle chunk
    big[-1] = 1.0
    assert m.reduce(big, check_finite=True) == Reduced.OK
    assert m.reduce(big, check_finite=True) == Reduced.OVERFLOW
    assert m.grad[-1] == 2.0  # the chunks after the overflow were still added
    stats = m.measure(norm=True, check_finite=True)
    assert not stats.finite
    assert not m.measure(norm=False, check_finite=True).finite


def test_busy_engines_share_the_threads_and_the_last_one_gets_them_all():
    """A job takes threads // busy engines as it starts; each engine's count is its own
    (OpenMP's is per thread), so one engine's share does not change another's."""
    before = torch.get_num_threads()
    budget = ThreadBudget(6)
    seen: dict[str, int] = {}
    first_in, second_done = threading.Event(), threading.Event()

    def first():
        with budget.share() as n:
            seen["first"] = n
            first_in.set()
            second_done.wait(10)
            seen["first after"] = torch.get_num_threads()

    t = threading.Thread(target=first)
    t.start()
    try:
        assert first_in.wait(10)
        with budget.share() as n:  # this thread is a second engine, busy at the same time
            seen["second"], seen["second set"] = n, torch.get_num_threads()
        second_done.set()
        t.join(10)
        with budget.share() as n:  # alone again
            seen["alone"] = n
    finally:
        second_done.set()
        torch.set_num_threads(before)
    assert seen == {"first": 6, "second": 3, "second set": 3, "first after": 6, "alone": 6}
    assert ThreadBudget(2).threads == 2 and ThreadBudget(0).threads == 1


def test_a_long_job_takes_a_new_share_as_others_start_and_finish():
    """rebalance() (called between an optimizer's chunks) moves a running job to the share
    that is fair now: fewer threads when another engine starts, all of them once it is gone;
    outside a job it changes nothing."""
    before = torch.get_num_threads()
    budget = ThreadBudget(6)
    seen: list[tuple[str, int]] = []
    other_in, other_out, checked = threading.Event(), threading.Event(), threading.Event()

    def other():
        with budget.share():
            other_in.set()
            checked.wait(10)
        other_out.set()

    try:
        with budget.share() as n:
            seen.append(("alone", n))
            t = threading.Thread(target=other)
            t.start()
            assert other_in.wait(10)
            rebalance()
            seen.append(("other started", torch.get_num_threads()))
            checked.set()
            assert other_out.wait(10)
            rebalance()
            seen.append(("other finished", torch.get_num_threads()))
            t.join(10)
        torch.set_num_threads(2)
        rebalance()  # no share held: nothing
        seen.append(("outside", torch.get_num_threads()))
    finally:
        checked.set()
        torch.set_num_threads(before)
    assert seen == [("alone", 6), ("other started", 3), ("other finished", 6), ("outside", 2)]


def test_engines_are_at_most_eight_and_share_every_thread():
    """Each engine thread keeps an OpenMP pool as large as the most threads it was given:
    engines beyond a few would only add pools. The threads are the number asked for."""
    engines = Engines(None, [None] * 20, 32, lambda done: None)
    try:
        assert engines.n == MAX_ENGINES == 8 and engines.budget.threads == 32
    finally:
        engines.close()
    few = Engines(None, [None] * 3, 32, lambda done: None)
    try:
        assert few.n == 3 and few.budget.threads == 32
    finally:
        few.close()
