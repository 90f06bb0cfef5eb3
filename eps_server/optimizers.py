"""Per-layer optimizers on flat buffers: AdamW, LAMB, SGD.

Each layer's master, optimizer state and (with bf16/fp16) compute copy share the flat layout
of protocol.tensors, where each optimizer group ("decay", "no_decay") is one contiguous span,
so an update is a few passes over whole spans, never a Python loop over the model's tensors.
State is created explicitly (zeros) when the optimizer is built, as a fresh torch optimizer
would have it, in the EPS process.

``step(parts, t, lr, grad_scale, cfg, keep)``: update t (0-based) with learning rate ``lr`` on
the gradient ``sum(parts) / grad_scale`` (the ranks' pushed gradients, summed in rank order in
fp32; ``grad_scale`` folds the fp16 loss scale and a clipping coefficient into one number),
with the settings ``cfg`` (read once per update by the server), and refresh the compute copy:

- AdamW runs one compiled pass (kernels.adamw) over pieces of the layer on the math pool:
  p, m, v read and written, the parts read where they lie, the compute copy written from the
  new master, and, with ``keep``, the summed gradient stored for a possible ``undo``;
- LAMB runs its two compiled passes (lamb_kernels), SGD torch ops, on the summed gradient in
  an fp32 buffer.

``states``: the dtype of the moments (AdamW's and LAMB's m and v; SGD's momentum stays fp32):
"fp32", or "bf16" (stochastic rounding, kernels.py), half the bytes, a master still fp32.

On a CUDA master (in-process baselines on a GPU) AdamW runs torch's fused kernel instead.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from protocol.tensors import LayerPlan, views

from . import kernels
from .buffers import BufferPool
from .config import OptimizerConfig
from .pool import MathPool, cut

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_INLINE = MathPool(1, inline=True)


def _sum(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The parts summed in fp32, rank order (a part in fp32 alone is itself)."""
    if len(parts) == 1 and parts[0].dtype == torch.float32:
        return parts[0]
    out = parts[0].float()
    for p in parts[1:]:
        out.add_(p)
    return out


def seeds(layer: int, t: int) -> tuple[int, int]:
    """The rounding-noise offsets of (layer, update t) for m and v (bf16 states)."""
    x = (layer * 0x9E3779B1 + t * 0x85EBCA77 + 0x165667B1) & 0xFFFFFFFF
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
    x = ((x ^ (x >> 12)) * 0x297A2D39) & 0xFFFFFFFF
    x ^= x >> 15
    return x, (x * 0x27D4EB2F + 0x165667B1) & 0xFFFFFFFF


class LayerOptimizer:
    can_undo = False  # undo(): the inverse of one step, for speculative updates

    def __init__(self, plan: LayerPlan, master: torch.Tensor, compute: torch.Tensor | None,
                 cfg: OptimizerConfig, *, pool: MathPool | None = None,
                 buffers: BufferPool | None = None):
        self.plan, self.master, self.compute, self.cfg = plan, master, compute, cfg
        self.pool = pool or _INLINE
        self.buffers = buffers or BufferPool()
        self.spans = [(group, start, end) for group, (start, end) in plan.groups.items()]
        self.state_dtype = STATE_DTYPES[cfg.states]
        self.base = 0  # the first element's index in the layer (shard mode: the span's start)
        # On the master's device: CUDA's fused kernels read the step count (and the gradient
        # scale) in the kernel, as torch.optim keeps them for fused=True.
        self.steps = torch.zeros((), dtype=torch.float32, device=master.device)

    def decay(self, group: str, cfg: OptimizerConfig | None = None) -> float:
        return (cfg or self.cfg).weight_decay if group == "decay" else 0.0

    def step(self, parts: tuple[torch.Tensor, ...], t: int, lr: float, grad_scale: float = 1.0,
             cfg: OptimizerConfig | None = None, keep: torch.Tensor | None = None) -> None:
        raise NotImplementedError

    def undo(self, grad: torch.Tensor, t: int, lr: float, grad_scale: float = 1.0,
             cfg: OptimizerConfig | None = None) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no undo")

    def publish(self) -> None:
        if self.compute is not None:
            self.compute.copy_(self.master)

    def _moment(self) -> torch.Tensor:
        return torch.zeros(self.master.numel(), dtype=self.state_dtype,
                           device=self.master.device)

    def _fp32_grad(self, parts, keep) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the summed fp32 gradient, a pooled buffer to give back or None)."""
        if keep is not None and keep.dtype == torch.float32:
            self._gather(parts, keep)
            return keep, None
        if len(parts) == 1 and parts[0].dtype == torch.float32 and keep is None:
            return parts[0], None
        buf = self.buffers.take(self.plan.numel)
        self._gather(parts, buf)
        if keep is not None:
            keep.copy_(buf if keep.dtype == torch.float32 else parts[0])
        return buf, buf

    def _gather(self, parts, out: torch.Tensor) -> None:
        if out.device.type != "cpu":
            out.copy_(_sum(parts))
            return
        arrays = [kernels.as_kernel_array(p) for p in parts]
        dst = kernels.as_kernel_array(out)
        self.pool.map(lambda lo, hi: kernels.gather(tuple(a[lo:hi] for a in arrays),
                                                    dst[lo:hi]),
                      cut(0, self.plan.numel))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Fill the state from a checkpoint's tensors; moments of another dtype are converted
        (fp32 -> bf16 rounds to nearest)."""
        for name, t in self.state_tensors().items():
            if name not in tensors:
                raise ValueError(f"optimizer state {name!r} of layer {self.plan.name} missing")
            if tensors[name].shape != t.shape:
                raise ValueError(f"optimizer state {name!r} of layer {self.plan.name} has shape "
                                 f"{tuple(tensors[name].shape)}, expected {tuple(t.shape)}")
            t.copy_(tensors[name])


class AdamW(LayerOptimizer):
    """torch.optim.AdamW semantics (decoupled weight decay, bias correction)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.exp_avg = self._moment()
        self.exp_avg_sq = self._moment()
        self.can_undo = self.master.device.type == "cpu"

    def _consts(self, n: float, lr: float, c: OptimizerConfig) -> tuple:
        """The kernel's scalars for step number n (1-based), as torch computes them."""
        bc1, bc2 = 1 - c.beta1 ** n, 1 - c.beta2 ** n
        return lr / bc1, math.sqrt(bc2)

    def _arrays(self):
        return (kernels.as_kernel_array(self.master), kernels.as_kernel_array(self.exp_avg),
                kernels.as_kernel_array(self.exp_avg_sq),
                kernels.as_kernel_array(self.compute))

    def step(self, parts, t, lr, grad_scale=1.0, cfg=None, keep=None) -> None:
        c = cfg or self.cfg
        if self.master.device.type != "cpu":
            return self._step_torch(parts, lr, grad_scale, c, keep)
        self.steps += 1
        n = float(self.steps)
        step_size, bc2_sqrt = self._consts(n, lr, c)
        p, m, v, cc = self._arrays()
        gs = [kernels.as_kernel_array(x) for x in parts]
        k = kernels.as_kernel_array(keep, parts[0].dtype)
        seed_m, seed_v = seeds(self.plan.index, int(n))

        def piece(lo: int, hi: int, wd: float) -> None:
            kernels.adamw(p[lo:hi], tuple(g[lo:hi] for g in gs), m[lo:hi], v[lo:hi],
                          cc[lo:hi] if cc.shape[0] else cc, k[lo:hi] if k.shape[0] else k,
                          self.base + lo, lr, wd, c.beta1, c.beta2, c.eps, step_size, bc2_sqrt,
                          grad_scale, seed_m, seed_v)

        self.pool.map(piece, [(lo, hi, self.decay(group, c)) for group, start, end in self.spans
                              for lo, hi in cut(start, end)])

    def undo(self, grad, t, lr, grad_scale=1.0, cfg=None) -> None:
        """Back to the state before the last step, which was made with ``grad`` (its kept
        sum), ``lr``, ``grad_scale`` and ``cfg``."""
        c = cfg or self.cfg
        n = float(self.steps)
        step_size, bc2_sqrt = self._consts(n, lr, c)
        p, m, v, cc = self._arrays()
        g = kernels.as_kernel_array(grad)
        seed_m, seed_v = seeds(self.plan.index, int(n) + (1 << 20))
        first = n == 1

        def piece(lo: int, hi: int, wd: float) -> None:
            kernels.adamw_undo(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi],
                               cc[lo:hi] if cc.shape[0] else cc, self.base + lo, lr, wd,
                               c.beta1, c.beta2, c.eps, step_size, bc2_sqrt, grad_scale, first,
                               seed_m, seed_v)

        self.pool.map(piece, [(lo, hi, self.decay(group, c)) for group, start, end in self.spans
                              for lo, hi in cut(start, end)])
        self.steps -= 1

    def _step_torch(self, parts, lr, grad_scale, c, keep) -> None:
        grad = _sum(parts)
        if keep is not None:
            keep.copy_(grad)
        self.steps += 1
        scale = None if grad_scale == 1.0 else torch.tensor(grad_scale, dtype=torch.float32,
                                                            device=self.master.device)
        for group, start, end in self.spans:
            torch._fused_adamw_([self.master[start:end]], [grad[start:end]],
                                [self.exp_avg[start:end]], [self.exp_avg_sq[start:end]], [],
                                [self.steps], lr=lr, beta1=c.beta1, beta2=c.beta2,
                                weight_decay=self.decay(group, c), eps=c.eps, amsgrad=False,
                                maximize=False, grad_scale=scale)
        self.publish()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "step": self.steps}


class Lamb(LayerOptimizer):
    """LAMB (You et al., 2020, Algorithm 2): Adam's bias-corrected direction plus decoupled
    weight decay, scaled per tensor by the trust ratio ||x|| / ||r|| (1 where a norm is 0; the
    ratio applies to every tensor, weight decay only to the "decay" group). Two compiled
    passes per layer (lamb_kernels), in pieces on the math pool; torch ops off the CPU."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.exp_avg = self._moment()
        self.exp_avg_sq = self._moment()
        self.starts = np.array([s.offset for s in self.plan.tensors], dtype=np.int64)
        self.ends = self.starts + np.array([s.numel for s in self.plan.tensors], dtype=np.int64)
        self.decays = np.array([s.group == "decay" for s in self.plan.tensors])
        self._pieces: list | None = None
        self._blocks: tuple | None = None  # (first block, block count) of each tensor

    def step(self, parts, t, lr, grad_scale=1.0, cfg=None, keep=None) -> None:
        from . import lamb_kernels  # compiled with the first LAMB step, not with every EPS

        c = cfg or self.cfg
        grad, scratch = self._fp32_grad(parts, keep)
        try:
            if self.master.device.type != "cpu" or not lamb_kernels.available():
                return self._step_torch(grad, lr, grad_scale, c)
            f = np.float32
            self.steps += 1
            n = float(self.steps)
            seed_m, seed_v = seeds(self.plan.index, int(n))
            bc1, bc2 = f(1 - c.beta1 ** n), f(1 - c.beta2 ** n)
            wd = np.where(self.decays, c.weight_decay, 0.0).astype(f)
            x, g = self.master.numpy(), grad.numpy()
            m, v = (kernels.as_kernel_array(s) for s in (self.exp_avg, self.exp_avg_sq))
            r_buf = self.buffers.take(self.plan.numel)
            r = r_buf.numpy()
            if self._blocks is None:
                self._blocks = lamb_kernels.blocks(self.starts, self.ends)
                count = int(self._blocks[1].sum())
                self._pieces = lamb_kernels.split(self.starts, self.ends,
                                                  max(1, -(-count * lamb_kernels.BLOCK
                                                           // PIECE_ELEMENTS)))
            first, count = self._blocks
            bx, br = (np.empty(int(count.sum()), dtype=f) for _ in range(2))
            self.pool.map(lambda s, e, t_, b: lamb_kernels.moments(
                x, g, m, v, r, s, e, wd[t_], b, f(c.beta1), f(c.beta2), bc1, bc2, f(c.eps),
                f(1 / grad_scale), bx, br, seed_m, seed_v), self._pieces)
            x_sq, r_sq = np.zeros(len(wd)), np.zeros(len(wd))
            lamb_kernels.norms(bx, br, first, count, x_sq, r_sq)
            x_norm, r_norm = np.sqrt(x_sq), np.sqrt(r_sq)
            ratio = np.where((x_norm > 0) & (r_norm > 0),
                             x_norm / np.maximum(r_norm, 1e-300), 1.0)
            step = (lr * ratio).astype(f)
            self.pool.map(lambda s, e, t_, b: lamb_kernels.apply(x, r, s, e, step[t_]),
                          self._pieces)
            self.buffers.give(r_buf)
            self.publish()
        finally:
            if scratch is not None:
                self.buffers.give(scratch)

    def _step_torch(self, grad, lr: float, grad_scale: float, c: OptimizerConfig) -> None:
        self.steps += 1
        n = float(self.steps)
        g = grad if grad_scale == 1.0 else grad / grad_scale
        m, v = self.exp_avg, self.exp_avg_sq
        m.mul_(c.beta1).add_(g, alpha=1 - c.beta1)
        v.mul_(c.beta2).addcmul_(g, g, value=1 - c.beta2)
        # r = m^ / (sqrt(v^) + eps) + wd * x, in one scratch buffer
        r = torch.div(v.float(), 1 - c.beta2 ** n).sqrt_().add_(c.eps)
        torch.div(m.float(), r, out=r).div_(1 - c.beta1 ** n)
        for group, start, end in self.spans:
            if self.decay(group, c):
                r[start:end].add_(self.master[start:end], alpha=self.decay(group, c))
        x_views, r_views = views(self.master, self.plan), views(r, self.plan)
        x_norm = torch.stack(torch._foreach_norm(x_views))
        r_norm = torch.stack(torch._foreach_norm(r_views))
        ratio = torch.where((x_norm > 0) & (r_norm > 0), x_norm / r_norm, 1.0)
        torch._foreach_mul_(r_views, list(ratio.mul_(-lr).unbind()))
        self.master.add_(r)  # padding of r is 0: m, v and x are 0 there
        self.publish()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "step": self.steps}


class Sgd(LayerOptimizer):
    """torch.optim.SGD semantics: coupled weight decay, momentum buffer started from the first
    gradient, no dampening or Nesterov."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.momentum_buffer = (torch.zeros_like(self.master) if self.cfg.momentum else None)

    def step(self, parts, t, lr, grad_scale=1.0, cfg=None, keep=None) -> None:
        c = cfg or self.cfg
        grad, scratch = self._fp32_grad(parts, keep)
        try:
            first = int(self.steps) == 0
            self.steps += 1
            for group, start, end in self.spans:
                p = self.master[start:end]
                d = grad[start:end] / grad_scale if grad_scale != 1.0 else grad[start:end]
                if self.decay(group, c):
                    d = d.add(p, alpha=self.decay(group, c))
                if self.momentum_buffer is not None:
                    buf = self.momentum_buffer[start:end]
                    if first:
                        buf.copy_(d)
                    else:
                        buf.mul_(c.momentum).add_(d)
                    d = buf
                p.add_(d, alpha=-lr)
            self.publish()
        finally:
            if scratch is not None:
                self.buffers.give(scratch)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {"step": self.steps}
        if self.momentum_buffer is not None:
            out["momentum_buffer"] = self.momentum_buffer
        return out


PIECE_ELEMENTS = 1 << 18  # LAMB's pieces: as the math pool's (pool.PIECE)

OPTIMIZERS = {"adamw": AdamW, "lamb": Lamb, "sgd": Sgd}


def make_optimizer(plan: LayerPlan, master: torch.Tensor, compute: torch.Tensor | None,
                   cfg: OptimizerConfig, **kw) -> LayerOptimizer:
    return OPTIMIZERS[cfg.name](plan, master, compute, cfg, **kw)
