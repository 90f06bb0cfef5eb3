"""LAMB's two passes over a layer as compiled loops (numba): torch has no fused LAMB kernel,
and composing it from eager ops costs a dozen passes over memory (~6x AdamW's time).

    moments(x, g, m, v, r, ...)  one pass: update m, v; write the LAMB direction
                                 r = m^ / (sqrt(v^) + eps) + wd * x to a scratch buffer, and sum
                                 x^2 and r^2 per tensor (for the trust ratios)
    apply(x, r, ...)             one pass: x -= lr * ratio_t * r

So an update moves 40 B/param (AdamW: 28). Loops run over whole contiguous slices (numba
vectorises those, not index ranges it cannot prove non-negative) with the numpy error model;
the fast-math flags only allow reassociation and reciprocal multiplication, never assume
finite values. The moments may be bf16 (kernels.py's element access, stochastic rounding).
Sums are fp32 within blocks of BLOCK elements (each block's sum kept), then float64 across a
tensor's blocks in order (``norms``), so a layer cut into segments at block boundaries, run
on several threads, gives the same bits as one. ``nogil`` lets the math pool's threads run
the pieces of a layer in parallel (optimizers.py).
"""

from __future__ import annotations

import numba
import numpy as np

from .kernels import ld, noise16, noise16b, to_sr

BLOCK = 4096
FASTMATH = {"reassoc", "contract", "arcp", "nsz"}


def _moments_block(x, g, m, v, r, w, b1, b2, bc1, bc2, eps, inv_scale, base, seed_m, seed_v):
    one = np.float32(1.0)
    sx = np.float32(0.0)
    sr = np.float32(0.0)
    for i in range(x.shape[0]):
        xi = x[i]
        gi = g[i] * inv_scale
        mi = b1 * ld(m, i) + (one - b1) * gi
        vi = b2 * ld(v, i) + (one - b2) * gi * gi
        ri = (mi / bc1) / (np.sqrt(vi / bc2) + eps) + w * xi
        sx += xi * xi
        sr += ri * ri
        m[i] = to_sr(m, mi, noise16(base + i, seed_m))
        v[i] = to_sr(v, vi, noise16b(base + i, seed_v))
        r[i] = ri
    return sx, sr


def _apply_one(x, r, step):
    for i in range(x.shape[0]):
        x[i] = x[i] - step * r[i]


def _moments(x, g, m, v, r, starts, ends, wd, first, b1, b2, bc1, bc2, eps, inv_scale, bx, br,
             seed_m, seed_v):
    """Segments [starts[s], ends[s]) with weight decay wd[s]; the sums of segment s's blocks
    go to bx, br from index first[s] on."""
    for s in range(starts.shape[0]):
        j = first[s]
        for lo in range(starts[s], ends[s], BLOCK):
            hi = min(ends[s], lo + BLOCK)
            bx[j], br[j] = _moments_block(x[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], r[lo:hi],
                                          wd[s], b1, b2, bc1, bc2, eps, inv_scale, lo, seed_m,
                                          seed_v)
            j += 1


def _norms(bx, br, first, count, x_sq, r_sq):
    """Per tensor t: its count[t] block sums from first[t] on, added in order in float64."""
    for t in range(first.shape[0]):
        sx = 0.0
        sr = 0.0
        for j in range(first[t], first[t] + count[t]):
            sx += bx[j]
            sr += br[j]
        x_sq[t] = sx
        r_sq[t] = sr


def _apply(x, r, starts, ends, step):
    for s in range(starts.shape[0]):
        _apply_one(x[starts[s]:ends[s]], r[starts[s]:ends[s]], step[s])


# Not cached: numba keys a cache on this file alone, and these loops inline kernels.py's.
_jit = numba.njit(nogil=True, fastmath=FASTMATH, error_model="numpy", cache=False)
_moments_block, _apply_one = _jit(_moments_block), _jit(_apply_one)
moments, norms, apply = _jit(_moments), _jit(_norms), _jit(_apply)


def available() -> bool:
    """The compiled passes are used (a test turns them off to check the torch ones)."""
    return True


def blocks(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first block index, block count) of each tensor, its blocks numbered across the layer."""
    count = (ends - starts + BLOCK - 1) // BLOCK
    return np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64), count


def split(starts: np.ndarray, ends: np.ndarray, k: int) -> list[tuple[np.ndarray, ...]]:
    """The layer's blocks cut into at most k pieces of about as many blocks each, every piece
    a set of segments (starts, ends, tensor, first block), cut only at block boundaries."""
    first, count = blocks(starts, ends)
    total = int(count.sum())
    bounds = [total * i // k for i in range(k + 1)]
    pieces = []
    for b0, b1 in zip(bounds[:-1], bounds[1:]):
        segs = []
        for t in range(len(starts)):
            lo, hi = max(b0, int(first[t])), min(b1, int(first[t] + count[t]))
            if lo < hi:
                s = int(starts[t]) + (lo - int(first[t])) * BLOCK
                segs.append((s, min(int(ends[t]), s + (hi - lo) * BLOCK), t, lo))
        if segs:
            pieces.append(tuple(np.array(c, dtype=np.int64) for c in zip(*segs)))
    return pieces
