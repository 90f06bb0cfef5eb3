"""The passes around an EPS update (in one process, no sockets): the dtype conversions of the
compiled kernels against torch's, bit for bit; the check of the ranks' gradients (a non-finite
element anywhere, in any part, finite parts whose sum overflows, the norm against float64);
the kept gradient; the math pool and its pieces; the buffer pool."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eps_server import kernels
from eps_server.buffers import BufferPool
from eps_server.config import OptimizerConfig
from eps_server.layer_math import LayerMath, all_finite
from eps_server.optimizers import make_optimizer
from eps_server.pool import PIECE, MathPool, cut
from protocol.tensors import LayerSpec, Manifest, TensorSpec, plan_layout

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# More than two pieces, not a multiple of one or of a block: ragged ends everywhere.
PLAN = plan_layout(Manifest(layers=(LayerSpec(name="l", kind="k", tensors=(
    TensorSpec(name="w", shape=(2 * PIECE + 1000,)),)),))).layers[0]
N = PLAN.numel  # the flat layer, padding included


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    nan = torch.isnan(a.float()) & torch.isnan(b.float())
    return bool(((a.view(ints) == b.view(ints)) | nan).all())


# ----------------------------------------------------------------------------- conversions


def test_every_half_value_loads_as_torch_converts_it():
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    out = np.empty(65536, np.float32)
    kernels.gather((kernels.as_kernel_array(every),), out)
    assert same_bits(torch.from_numpy(out), every.float())
    bf = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    kernels.gather((kernels.as_kernel_array(bf),), out)
    assert same_bits(torch.from_numpy(out), bf.float())


EDGES = [0.0, -0.0, 65504.0, 65519.99, 65520.0, 65536.0, 1e38, math.inf, -math.inf,
         2.0 ** -24, 2.0 ** -25, 2.0 ** -25 * 1.0001, 2.0 ** -14, 2.0 ** -14 * (1 - 2.0 ** -11),
         1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 3.3895e38]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp32_is_rounded_to_nearest_even_as_torch_does(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(1 << 16, generator=g) * s for s in (1e-8, 1e-5, 1, 1e4, 1e30)]
                  + [torch.tensor(EDGES), -torch.tensor(EDGES),
                     torch.randint(0, 2**31 - 1, (1 << 16,), generator=g,
                                   dtype=torch.int32).view(torch.float32)])
    out = torch.empty(x.numel(), dtype=dtype)
    kernels.copy_round(x.numpy(), kernels.as_kernel_array(out))
    assert same_bits(out, x.to(dtype))


# ----------------------------------------------------------------------------- the check


def layer_math(pool=None, name="sgd") -> LayerMath:
    cfg = OptimizerConfig(name=name, lr=0.1, weight_decay=0.0)
    pool = pool or MathPool(1, inline=True)
    buffers = BufferPool()
    return LayerMath(PLAN, make_optimizer(PLAN, torch.zeros(N), None, cfg, pool=pool,
                                          buffers=buffers), pool, buffers)


# Each mix of dtypes is a kernel compiled of its own (a second or so): a few of them.
MIXES = [(torch.float32,), (torch.bfloat16,), (torch.float16,),
         (torch.bfloat16, torch.float32), (torch.float16, torch.float16, torch.bfloat16)]


@settings(max_examples=60, deadline=None)
@given(dtypes=st.sampled_from(MIXES),
       bad=st.sampled_from([math.nan, math.inf, -math.inf]),
       who=st.integers(0, 2), where=st.floats(0, 1, exclude_max=True))
def test_a_non_finite_element_is_blamed_on_its_part(dtypes, bad, who, where):
    parts = [torch.randn(N).to(d) for d in dtypes]
    m = layer_math()
    assert m.check(tuple(parts)).finite
    who %= len(parts)
    parts[who][int(where * N)] = bad
    checked = m.check(tuple(parts))
    assert checked.refused == (who,) and not checked.overflow
    assert not math.isfinite(checked.norm_sq)


def test_the_largest_finite_values_are_finite_and_their_sum_is_an_overflow():
    """A check by summing would call them infinite; two of them do overflow together."""
    m = layer_math()
    for dtype in DTYPES:
        big = torch.full((N,), torch.finfo(dtype).max, dtype=dtype)
        assert m.check((big,)).finite
    big = torch.zeros(N)
    big[PIECE + 7] = torch.finfo(torch.float32).max  # in the middle piece
    checked = m.check((big, big))
    assert checked.overflow and checked.refused == () and not checked.finite
    assert all_finite(torch.empty(0)) and not all_finite(torch.tensor([1.0, math.nan]))


def test_the_norm_equals_the_float64_norm_and_survives_squares_beyond_fp32():
    """fp32 sums within blocks of 4096 (vectorised), float64 across them: within 1e-7 of the
    float64 norm (4e-9 here); a block whose fp32 squares overflow or underflow is summed in
    float64 instead."""
    g = torch.randn(N, generator=torch.Generator().manual_seed(0)) * 1e-3
    m = layer_math()
    want = float(torch.linalg.vector_norm(g.double()))
    assert math.sqrt(m.check((g,)).norm_sq) == pytest.approx(want, rel=1e-7)
    two = m.check((g, g.bfloat16()))
    assert math.sqrt(two.norm_sq) == pytest.approx(
        float(torch.linalg.vector_norm((g + g.bfloat16().float()).double())), rel=1e-7)
    huge = torch.full((N,), 1e30)  # squares are 1e60, far beyond fp32: fine in float64
    assert math.sqrt(m.check((huge,)).norm_sq) == pytest.approx(float(huge[0]) * math.sqrt(N),
                                                                rel=1e-9)
    tiny = torch.full((N,), 1e-30)
    assert math.sqrt(m.check((tiny,)).norm_sq) == pytest.approx(float(tiny[0]) * math.sqrt(N),
                                                                rel=1e-9)
    assert m.check((torch.zeros(N),)).norm_sq == 0.0


def test_the_check_gives_the_same_bits_however_many_threads():
    g = [torch.randn(N).bfloat16(), torch.randn(N)]
    pool = MathPool(3)
    try:
        assert layer_math(pool).check(tuple(g)) == layer_math().check(tuple(g))
    finally:
        pool.close()


def test_a_gradient_of_another_size_is_an_error_not_a_read_past_its_end():
    m = layer_math()
    for size in (N - 1, N + 1):
        with pytest.raises(ValueError, match="elements"):
            m.check((torch.ones(N), torch.ones(size)))


@pytest.mark.parametrize("dtypes", [(torch.bfloat16,), (torch.float16,), (torch.float32,),
                                    (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_kept_gradient_is_exact(dtypes, optimizer):
    """One rank's gradient is kept in its own dtype (2 bytes a parameter in bf16), several
    ranks' as their fp32 sum; optimizers that cannot undo keep fp32 (they step on it)."""
    m = layer_math(name=optimizer)
    parts = tuple(torch.randn(N).to(d) for d in dtypes)
    kept = m.keep(parts)
    total = parts[0].float()
    for p in parts[1:]:
        total = total + p.float()
    single = len(parts) == 1 and optimizer == "adamw"
    assert kept.dtype == (parts[0].dtype if single else torch.float32)
    assert torch.equal(kept.float(), total)
    m.release(kept)
    assert m.buffers.in_use_bytes == 0 and m.buffers.take(N, kept.dtype) is kept


# ----------------------------------------------------------------------------- pools


@settings(max_examples=100, deadline=None)
@given(lo=st.integers(0, 5 * PIECE), length=st.integers(0, 5 * PIECE),
       piece=st.sampled_from([kernels.BLOCK, 3 * kernels.BLOCK, PIECE]))
def test_pieces_cover_a_range_once_cut_at_multiples_of_the_piece(lo, length, piece):
    ranges = cut(lo, lo + length, piece)
    assert sum(hi - a for a, hi in ranges) == length
    assert all(a < hi <= a + piece for a, hi in ranges)
    assert all(a2 == hi1 for (_, hi1), (a2, _) in zip(ranges, ranges[1:]))
    assert all(a % piece == 0 for a, _ in ranges[1:])


def test_the_pool_runs_pieces_on_its_threads_and_reports_the_first_error():
    pool = MathPool(3)
    try:
        names = pool.map(lambda i: (i, threading.current_thread().name), [(i,) for i in range(9)])
        assert [i for i, _ in names] == list(range(9))
        assert {n for _, n in names} <= {f"eps-math-{k}" for k in range(3)}

        def fail(i):
            if i == 4:
                raise ValueError("piece 4")
            return i

        with pytest.raises(ValueError, match="piece 4"):
            pool.map(fail, [(i,) for i in range(8)])
        assert pool.map(lambda i: i * i, [(3,), (4,)]) == [9, 16]  # still serving
    finally:
        pool.close()


def test_buffers_are_reused_and_the_peak_is_what_was_held_at_once():
    pool = BufferPool()
    a, b = pool.take(100), pool.take(100)
    pool.give(a)
    c = pool.take(100, torch.float32)
    assert c is a and pool.peak_bytes == 800 and pool.in_use_bytes == 800
    pool.give(b)
    pool.give(c)
    assert pool.in_use_bytes == 0 and pool.allocated_bytes == 800
    pool.trim()
    assert pool.allocated_bytes == 0
