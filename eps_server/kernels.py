"""The EPS's passes over a layer as compiled loops (numba, ``nogil``): each reads and writes
every byte it touches once, whatever the dtypes, so an update moves what the mathematics
needs and no more, and the math pool (pool.py) runs pieces of one layer on every core.

    check(parts, ...)        the sum of the ranks' gradients (rank order), never stored: which
                             part has a non-finite element, whether the sum has one, and the
                             sum's squares per block of BLOCK elements (for norms)
    adamw(p, parts, ...)     torch.optim.AdamW on the sum, the compute copy written from the
                             new master in the same pass, and (optionally) the sum kept for
                             a later redo
    adamw_undo(p, g, ...)    the inverse of one ``adamw`` pass given its gradient: the state
                             before it, to rounding (a speculative update rolled back)
    gather(parts, out)       the sum into ``out`` (kept until the step is decided, or the
                             fp32 gradient of an optimizer without a kernel of its own)

Every kernel takes one piece: arrays already sliced to it (numba vectorises a loop over a
whole array, not one over an index range it cannot prove non-negative), ``base`` its first
element's index in the layer. A dtype torch has and numpy lacks travels as its bits:
**uint16 is bfloat16, int16 is float16** (``as_kernel_array``); ``ld``/``to`` convert to and
from float32 with round-to-nearest-even, as torch's ``.to()`` does, bit for bit.

Optimizer moments kept in bf16 are written with stochastic rounding (``to_sr``): round to
nearest would drop every change below half a bf16 ulp, and with beta2 = 0.999 most of v's
changes are that small (v would stop following the gradient). The noise is a Weyl sequence
of the element index (one multiplier for m, another for v), offset per (layer, step), so a
run repeats bit for bit.

Numba computes integer expressions in 64 bits; the bit tricks below mask what they keep.
Element-wise passes are compiled without fast-math: each operation rounds as IEEE says, so
every variant (dtypes, world size, with or without a copy) gives the same bits for the same
values. The block sums alone may be reassociated and fused (vectorised); nothing assumes
finite values.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import types
from numba.extending import intrinsic, overload, register_jitable

BLOCK = 4096  # elements per block sum: pieces are cut at multiples of it
_U32 = np.uint32

# ----------------------------------------------------------------------------- element access


@intrinsic
def _f32_from_bits(typingctx, x):
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))
    return sig, codegen


@intrinsic
def _bits_from_f32(typingctx, x):
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))
    return sig, codegen


@register_jitable
def _half_to_float(h):
    """IEEE half bits -> float32, exact (subnormals, inf and NaN included)."""
    h = _U32(h) & _U32(0xFFFF)
    sign = (h & _U32(0x8000)) << _U32(16)
    exp = (h >> _U32(10)) & _U32(0x1F)
    mant = h & _U32(0x3FF)
    if exp == 0x1F:  # inf / NaN
        return _f32_from_bits(_U32(sign | _U32(0x7F800000) | (mant << _U32(13))))
    if exp == 0:  # zero / subnormal: mant * 2^-24, exact in float32
        v = np.float32(mant) * np.float32(5.9604644775390625e-08)
        return -v if sign else v
    return _f32_from_bits(_U32(sign | ((exp + _U32(112)) << _U32(23)) | (mant << _U32(13))))


@register_jitable
def _float_to_half(f):
    """float32 -> IEEE half bits, round to nearest even (as torch), overflow to inf."""
    x = _bits_from_f32(f)
    sign = (x >> _U32(16)) & _U32(0x8000)
    a = x & _U32(0x7FFFFFFF)
    if a > _U32(0x7F800000):  # NaN: a quiet one
        return np.int16(np.uint16(sign | _U32(0x7E00)))
    if a >= _U32(0x477FF000):  # from 65520 on: inf
        return np.int16(np.uint16(sign | _U32(0x7C00)))
    if a < _U32(0x38800000):  # below 2^-14: subnormal, a count of 2^-24 rounded to even
        r = np.rint(_f32_from_bits(a) * np.float32(16777216.0))
        return np.int16(np.uint16(sign | _U32(r)))
    # normal: rebias the exponent, round the 13 dropped bits to nearest even
    m = (a + _U32(0xC8000FFF) + ((a >> _U32(13)) & _U32(1))) & _U32(0xFFFFFFFF)
    return np.int16(np.uint16(sign | (m >> _U32(13))))


@register_jitable
def _bf16_rne(x):
    b = _bits_from_f32(x)
    r = ((b + _U32(0x7FFF) + ((b >> _U32(16)) & _U32(1))) >> _U32(16)) & _U32(0xFFFF)
    nan = _U32((b & _U32(0x7FFFFFFF)) > _U32(0x7F800000))  # NaN: 0x7FC0, as torch (no branch:
    return np.uint16((r * (_U32(1) - nan) + _U32(0x7FC0) * nan) & _U32(0xFFFF))  # it vectorises)


def ld(a, i):
    """a[i] as float32."""


@overload(ld, inline="always")
def _ld(a, i):
    if a.dtype == types.float32:
        return lambda a, i: a[i]
    if a.dtype == types.uint16:  # bfloat16
        return lambda a, i: _f32_from_bits(_U32(a[i]) << _U32(16))
    if a.dtype == types.int16:  # float16
        return lambda a, i: _half_to_float(a[i])
    raise numba.errors.TypingError(f"no float view of {a.dtype}")


def to(a, x):
    """float32 ``x`` as an element of ``a`` (rounded to nearest even): ``a[i] = to(a, x)``.
    (A store inside an inlined helper stops LLVM from vectorising the loop; a value does not.)"""


@overload(to, inline="always")
def _to(a, x):
    if a.dtype == types.float32:
        return lambda a, x: x
    if a.dtype == types.uint16:
        return lambda a, x: _bf16_rne(x)
    if a.dtype == types.int16:
        return lambda a, x: _float_to_half(x)
    raise numba.errors.TypingError(f"no float view of {a.dtype}")


def to_sr(a, x, noise):
    """float32 ``x`` as an element of ``a``: exact into float32, into bf16 rounded
    stochastically by ``noise`` (16 bits)."""


@overload(to_sr, inline="always")
def _to_sr(a, x, noise):
    if a.dtype == types.float32:
        return lambda a, x, noise: x
    if a.dtype == types.uint16:
        def impl(a, x, noise):
            b = _bits_from_f32(x)
            finite = _U32((b & _U32(0x7F800000)) != _U32(0x7F800000))  # inf, NaN: unrounded
            return np.uint16(((b + noise * finite) >> _U32(16)) & _U32(0xFFFF))
        return impl
    raise numba.errors.TypingError(f"no stochastic rounding into {a.dtype}")


@register_jitable
def noise16(i, seed):
    """16 bits of a Weyl sequence: element i's rounding noise for ``seed`` (m's)."""
    return ((_U32(i) * _U32(0x9E3779B9) + _U32(seed)) >> _U32(16)) & _U32(0xFFFF)


@register_jitable
def noise16b(i, seed):
    """Another Weyl sequence (another multiplier: v's noise is not m's shifted)."""
    return ((_U32(i) * _U32(0x85EBCA77) + _U32(seed)) >> _U32(16)) & _U32(0xFFFF)


def grad_sum(parts, i):
    """The ranks' gradients at element i summed in float32, rank 0 first."""


@overload(grad_sum, inline="always")
def _grad_sum(parts, i):
    # Unrolled for the tuple's length (one compiled loop per world size): an indexed loop
    # over the tuple would not vectorise.
    count = len(parts)
    body = " + ".join(f"ld(parts[{k}], i)" for k in range(count))
    scope = {"ld": ld}
    exec(f"def impl(parts, i):\n    return {body}\n", scope)
    return scope["impl"]


@register_jitable
def _finite(x):
    return (_bits_from_f32(x) & _U32(0x7F800000)) != _U32(0x7F800000)


# ----------------------------------------------------------------------------- kernels

_jit = numba.njit(nogil=True, error_model="numpy", cache=True)
_jit_sum = numba.njit(nogil=True, fastmath={"reassoc", "contract"}, error_model="numpy",
                     cache=True)


@_jit_sum
def _square_sum(parts):
    """The sum's squares over a block, in fp32 (8 lanes, vectorised): within 1e-6 of the
    float64 sum over a block, at memory speed (float64 lanes made the check compute-bound)."""
    acc = np.float32(0.0)
    for i in range(parts[0].shape[0]):
        s = grad_sum(parts, i)
        acc += s * s
    return acc


@_jit_sum
def _square_sum64(parts):
    acc = 0.0
    for i in range(parts[0].shape[0]):
        s = np.float64(grad_sum(parts, i))
        acc += s * s
    return acc


def blame(parts, i, bad):
    """bad[k] = 1 for each part k whose element i is not finite; True if none is."""


@overload(blame, inline="always")
def _blame_one(parts, i, bad):
    lines = ["def impl(parts, i, bad):", "    every = True"]
    for k in range(len(parts)):  # unrolled: the parts may differ in dtype
        lines += [f"    if not _finite(ld(parts[{k}], i)):", f"        bad[{k}] = 1",
                  "        every = False"]
    scope = {"ld": ld, "_finite": _finite}
    exec("\n".join([*lines, "    return every\n"]), scope)
    return scope["impl"]


@_jit
def _blame(parts, bad):
    """Which parts (and whether the sum) have a non-finite element."""
    for i in range(parts[0].shape[0]):
        if blame(parts, i, bad) and not _finite(grad_sum(parts, i)):
            bad[len(parts)] = 1


@_jit
def check(parts, sums, bad):
    """One piece (its length a multiple of BLOCK, but for a layer's last): ``sums[b]`` = the
    sum's squares over block b (in fp32, or float64 where fp32 squares would overflow or
    underflow; not finite where an element is not); ``bad[k]`` = 1
    if part k has a non-finite element, ``bad[len(parts)]`` = 1 if the sum has one where
    every part is finite."""
    n = parts[0].shape[0]
    for b in range(sums.shape[0]):
        lo = b * BLOCK
        hi = min(n, lo + BLOCK)
        block = tuple_slice(parts, lo, hi)
        acc = np.float64(_square_sum(block))
        if not np.isfinite(acc) or acc < 1e-30:  # beyond fp32 squares' range: again in float64
            acc = _square_sum64(block)
        sums[b] = acc
        if not np.isfinite(acc):
            _blame(block, bad)


def tuple_slice(parts, lo, hi):
    """(p[lo:hi] for p in parts) as a tuple."""


@overload(tuple_slice, inline="always")
def _tuple_slice(parts, lo, hi):
    body = ", ".join(f"parts[{k}][lo:hi]" for k in range(len(parts)))
    scope: dict = {}
    exec(f"def impl(parts, lo, hi):\n    return ({body},)\n", scope)
    return scope["impl"]


@_jit
def adamw(p, parts, m, v, c, keep, base, lr, wd, b1, b2, eps, step_size, bc2_sqrt,
          grad_scale, seed_m, seed_v):
    """AdamW on g = sum(parts) / grad_scale, as torch's fused kernel: p *= 1 - lr*wd;
    m += (1-b1)(g-m); v = b2 v + (1-b2) g^2; p -= step_size * m / (sqrt(v)/bc2_sqrt + eps),
    the two divisions by constants as multiplications by their reciprocals (a vector division
    costs as much as the rest of the element's arithmetic; the results differ from torch's
    in the last bit at most).
    ``c``: the compute copy (empty: none); ``keep``: the sum is stored there too (empty: not)."""
    decay = np.float32(1.0) - np.float32(lr) * np.float32(wd)
    one = np.float32(1.0)
    b1 = np.float32(b1)
    b2 = np.float32(b2)
    eps = np.float32(eps)
    step_size = np.float32(step_size)
    inv_bc2 = np.float32(1.0 / bc2_sqrt)
    inv_scale = np.float32(1.0 / grad_scale)
    kept = keep.shape[0] > 0
    copy = c.shape[0] > 0
    for i in range(p.shape[0]):  # (LLVM takes the loop-invariant branches out of the loop)
        s = grad_sum(parts, i)
        if kept:
            keep[i] = to(keep, s)
        g = s * inv_scale
        mi = ld(m, i)
        mi = mi + (one - b1) * (g - mi)
        vi = b2 * ld(v, i) + (one - b2) * g * g
        pi = p[i] * decay - step_size * mi / (np.sqrt(vi) * inv_bc2 + eps)
        p[i] = pi
        m[i] = to_sr(m, mi, noise16(base + i, seed_m))
        v[i] = to_sr(v, vi, noise16b(base + i, seed_v))
        if copy:
            c[i] = to(c, pi)


@_jit
def adamw_undo(p, g, m, v, c, base, lr, wd, b1, b2, eps, step_size, bc2_sqrt, grad_scale,
               first, seed_m, seed_v):
    """Undo one ``adamw`` pass made with the (kept, unscaled) gradient ``g`` and the same
    settings: p, m, v as they were before it, to rounding (``first``: the moments were 0)."""
    decay = np.float32(1.0) - np.float32(lr) * np.float32(wd)
    one = np.float32(1.0)
    b1 = np.float32(b1)
    b2 = np.float32(b2)
    eps = np.float32(eps)
    step_size = np.float32(step_size)
    inv_bc2 = np.float32(1.0 / bc2_sqrt)
    inv_scale = np.float32(1.0 / grad_scale)
    zero_m = first or b1 == 0  # the old m does not matter with b1 = 0
    zero_v = first or b2 == 0
    copy = c.shape[0] > 0
    for i in range(p.shape[0]):
        gi = ld(g, i) * inv_scale
        mi = ld(m, i)
        vi = ld(v, i)
        pi = (p[i] + step_size * mi / (np.sqrt(vi) * inv_bc2 + eps)) / decay
        p[i] = pi
        mo = np.float32(0.0) if zero_m else (mi - (one - b1) * gi) / b1
        vo = np.float32(0.0) if zero_v else max((vi - (one - b2) * gi * gi) / b2,
                                                 np.float32(0.0))
        m[i] = to_sr(m, mo, noise16(base + i, seed_m))
        v[i] = to_sr(v, vo, noise16b(base + i, seed_v))
        if copy:
            c[i] = to(c, pi)


@_jit
def gather(parts, out):
    """out = the sum of the parts (rank order), in out's dtype."""
    for i in range(out.shape[0]):
        out[i] = to(out, grad_sum(parts, i))


@_jit
def copy_round(src, dst):
    """dst = src (float32) in dst's dtype, rounded to nearest even."""
    for i in range(dst.shape[0]):
        dst[i] = to(dst, src[i])


# ----------------------------------------------------------------------------- arrays

_BITS = {torch.float32: torch.float32, torch.bfloat16: torch.uint16,
         torch.float16: torch.int16}
_EMPTY = {torch.float32: np.empty(0, np.float32), torch.bfloat16: np.empty(0, np.uint16),
          torch.float16: np.empty(0, np.int16)}


def as_kernel_array(t: torch.Tensor | None, like: torch.dtype = torch.float32) -> np.ndarray:
    """A numpy view of flat tensor ``t`` the kernels read (bf16 as uint16, fp16 as int16);
    None is an empty array of ``like``'s kind (no compute copy, nothing kept)."""
    if t is None:
        return _EMPTY[like]
    view = _BITS[t.dtype]
    return (t if view is t.dtype else t.view(view)).numpy()


def block_count(numel: int) -> int:
    return (numel + BLOCK - 1) // BLOCK


def warm(world_size: int, grad_dtypes: tuple[torch.dtype, ...], compute: torch.dtype | None,
         states: torch.dtype) -> None:
    """Compile (or load from numba's cache) the passes a job of this shape will run, so the
    first step does not wait for the compiler: the check and AdamW for ``world_size`` parts of
    each gradient dtype, kept or not, and the undo."""
    n = BLOCK + 3
    p, sums = np.zeros(n, np.float32), np.zeros(2)
    moments = [as_kernel_array(torch.zeros(n, dtype=states)) for _ in range(2)]
    c = as_kernel_array(None if compute is None else torch.zeros(n, dtype=compute))
    for dtype in grad_dtypes:
        parts = tuple(as_kernel_array(torch.zeros(n, dtype=dtype)) for _ in range(world_size))
        check(parts, sums, np.zeros(world_size + 1, np.uint8))
        keep = as_kernel_array(torch.zeros(n, dtype=dtype if world_size == 1
                                           else torch.float32))
        for k in (_EMPTY[dtype if world_size == 1 else torch.float32], keep):
            adamw(p, parts, *moments, c, k, 0, 1e-3, 0.0, 0.9, 0.999, 1e-8, 1e-2, 0.03, 1.0,
                  0, 0)
        adamw_undo(p, keep, *moments, c, 0, 1e-3, 0.0, 0.9, 0.999, 1e-8, 1e-2, 0.03, 1.0,
                   False, 0, 0)
