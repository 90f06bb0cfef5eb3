"""Per-layer optimizers on flat fp32 buffers: AdamW (torch's fused kernel), LAMB, SGD.

Each layer's master, reduced gradient, optimizer state and (with bf16/fp16) compute copy share
the flat layout of protocol.tensors, where each optimizer group ("decay", "no_decay") is one
contiguous span. So an update is a few calls over whole spans, never a Python loop over the
model's tensors. State is created explicitly (zeros) when the optimizer is built, as a fresh
torch optimizer would have it, in the EPS process.

``step(t, lr, grad_scale, cfg)``: apply update t (0-based) with learning rate ``lr`` to the
gradient divided by ``grad_scale`` (the fp16 loss scale and the clipping coefficient, folded
into one number), with the settings ``cfg`` (read once per update by the server, so a runtime
change never mixes old and new values within one), and refresh the compute copy:
- AdamW runs torch's fused kernel chunk by chunk and writes each chunk's compute copy while the
  chunk is still in cache (one sweep over memory instead of two);
- LAMB and SGD update whole spans, then copy (a second, cheaper sweep).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from protocol.tensors import LayerPlan, views

from .config import OptimizerConfig, available_cores
from .threads import rebalance

# Elements per fused call when a compute copy is written: p, g, m, v of a chunk (4 MiB) are
# still in cache for the copy; measured best of 64K..4M on a 2-core EPYC (32 MiB L3). Without
# a compute copy, chunks of BIG_CHUNK: between chunks the engine's thread share is rebalanced
# (threads.py), at no cost worth measuring.
CHUNK = 1 << 18
BIG_CHUNK = 1 << 22


class LayerOptimizer:
    def __init__(self, plan: LayerPlan, master: torch.Tensor, grad: torch.Tensor,
                 compute: torch.Tensor | None, cfg: OptimizerConfig):
        self.plan, self.master, self.grad, self.compute, self.cfg = (
            plan, master, grad, compute, cfg)
        self.spans = [(group, start, end) for group, (start, end) in plan.groups.items()]
        # On the master's device: CUDA's fused kernels read the step count (and the gradient
        # scale) in the kernel, as torch.optim keeps them for fused=True (in-process baselines
        # on a GPU; the EPS's are on the CPU).
        self.steps = torch.zeros((), dtype=torch.float32, device=master.device)

    def decay(self, group: str, cfg: OptimizerConfig | None = None) -> float:
        return (cfg or self.cfg).weight_decay if group == "decay" else 0.0

    def step(self, t: int, lr: float, grad_scale: float = 1.0,
             cfg: OptimizerConfig | None = None) -> None:
        raise NotImplementedError

    def publish(self) -> None:
        if self.compute is not None:
            self.compute.copy_(self.master)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in self.state_tensors().items():
            if name not in tensors:
                raise ValueError(f"optimizer state {name!r} of layer {self.plan.name} missing")
            if tensors[name].shape != t.shape:
                raise ValueError(f"optimizer state {name!r} of layer {self.plan.name} has shape "
                                 f"{tuple(tensors[name].shape)}, expected {tuple(t.shape)}")
            t.copy_(tensors[name])


class AdamW(LayerOptimizer):
    """torch.optim.AdamW semantics (decoupled weight decay, bias correction), fused kernel."""

    def __init__(self, *args, chunk: int = CHUNK):
        super().__init__(*args)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.chunk = chunk

    def step(self, t: int, lr: float, grad_scale: float = 1.0,
             cfg: OptimizerConfig | None = None) -> None:
        c = cfg or self.cfg
        self.steps += 1
        scale = None if grad_scale == 1.0 else torch.tensor(grad_scale, dtype=torch.float32,
                                                            device=self.master.device)
        chunk = self.chunk if self.compute is not None else max(self.chunk, BIG_CHUNK)
        for group, start, end in self.spans:
            for lo in range(start, end, chunk):
                rebalance()
                hi = min(end, lo + chunk)
                p = self.master[lo:hi]
                torch._fused_adamw_([p], [self.grad[lo:hi]], [self.exp_avg[lo:hi]],
                                    [self.exp_avg_sq[lo:hi]], [], [self.steps], lr=lr,
                                    beta1=c.beta1, beta2=c.beta2, weight_decay=self.decay(group, c),
                                    eps=c.eps, amsgrad=False, maximize=False, grad_scale=scale)
                if self.compute is not None:
                    self.compute[lo:hi].copy_(p)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "step": self.steps}


class Lamb(LayerOptimizer):
    """LAMB (You et al., 2020, Algorithm 2): Adam's bias-corrected direction plus decoupled
    weight decay, scaled per tensor by the trust ratio ||x|| / ||r|| (1 where a norm is 0; the
    ratio applies to every tensor, weight decay only to the "decay" group). Two compiled
    passes per layer (lamb_kernels), each cut in pieces over the threads of the engine's
    share; torch ops when numba is missing or off the CPU."""

    def __init__(self, *args):
        super().__init__(*args)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.starts = np.array([s.offset for s in self.plan.tensors], dtype=np.int64)
        self.ends = self.starts + np.array([s.numel for s in self.plan.tensors], dtype=np.int64)
        self.decays = np.array([s.group == "decay" for s in self.plan.tensors])
        self._pieces: dict[int, list] = {}  # the layer cut for k threads
        self._blocks: tuple | None = None  # (first block, block count) of each tensor

    def step(self, t: int, lr: float, grad_scale: float = 1.0,
             cfg: OptimizerConfig | None = None) -> None:
        from . import lamb_kernels  # numba loads with the first LAMB step, not with every EPS

        if not lamb_kernels.available() or self.master.device.type != "cpu":
            return self._step_torch(t, lr, grad_scale, cfg or self.cfg)
        c, f = cfg or self.cfg, np.float32
        self.steps += 1
        n = float(self.steps)
        bc1, bc2 = f(1 - c.beta1 ** n), f(1 - c.beta2 ** n)
        wd = np.where(self.decays, c.weight_decay, 0.0).astype(f)
        x, g = self.master.numpy(), self.grad.numpy()
        m, v = self.exp_avg.numpy(), self.exp_avg_sq.numpy()
        r = _scratch(x.shape[0])
        if self._blocks is None:
            self._blocks = lamb_kernels.blocks(self.starts, self.ends)
        first, count = self._blocks
        bx, br = (np.empty(int(count.sum()), dtype=f) for _ in range(2))
        _in_pieces(self._cut(), lambda s, e, t, b: lamb_kernels.moments(
            x, g, m, v, r, s, e, wd[t], b, f(c.beta1), f(c.beta2), bc1, bc2, f(c.eps),
            f(1 / grad_scale), bx, br))
        x_sq, r_sq = np.zeros(len(wd)), np.zeros(len(wd))
        lamb_kernels.norms(bx, br, first, count, x_sq, r_sq)
        x_norm, r_norm = np.sqrt(x_sq), np.sqrt(r_sq)
        ratio = np.where((x_norm > 0) & (r_norm > 0), x_norm / np.maximum(r_norm, 1e-300), 1.0)
        step = (lr * ratio).astype(f)
        _in_pieces(self._cut(), lambda s, e, t, b: lamb_kernels.apply(x, r, s, e, step[t]))
        self.publish()

    def _cut(self) -> list:
        """The layer in pieces for the threads this engine's share holds now (one piece per
        MIN_PIECE elements at most); the same bits whatever the cut (lamb_kernels)."""
        from . import lamb_kernels

        rebalance()
        k = max(1, min(torch.get_num_threads(), self.plan.numel // MIN_PIECE))
        if k not in self._pieces:
            self._pieces[k] = lamb_kernels.split(self.starts, self.ends, k)
        return self._pieces[k]

    def _step_torch(self, t: int, lr: float, grad_scale: float, c: OptimizerConfig) -> None:
        self.steps += 1
        n = float(self.steps)
        g = self.grad if grad_scale == 1.0 else self.grad / grad_scale
        m, v = self.exp_avg, self.exp_avg_sq
        m.mul_(c.beta1).add_(g, alpha=1 - c.beta1)
        v.mul_(c.beta2).addcmul_(g, g, value=1 - c.beta2)
        # r = m^ / (sqrt(v^) + eps) + wd * x, in one scratch buffer
        r = torch.div(v, 1 - c.beta2 ** n).sqrt_().add_(c.eps)
        torch.div(m, r, out=r).div_(1 - c.beta1 ** n)
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

    def __init__(self, *args):
        super().__init__(*args)
        self.momentum_buffer = torch.zeros_like(self.master) if self.cfg.momentum else None

    def step(self, t: int, lr: float, grad_scale: float = 1.0,
             cfg: OptimizerConfig | None = None) -> None:
        c = cfg or self.cfg
        first = int(self.steps) == 0
        self.steps += 1
        for group, start, end in self.spans:
            p = self.master[start:end]
            d = self.grad[start:end] / grad_scale if grad_scale != 1.0 else self.grad[start:end]
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

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {"step": self.steps}
        if self.momentum_buffer is not None:
            out["momentum_buffer"] = self.momentum_buffer
        return out


_local = threading.local()


MIN_PIECE = 1 << 18  # elements: below, handing a piece to another thread costs more
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _in_pieces(pieces: list, fn) -> None:
    """fn(*piece) for every piece: the first on this thread, the others on a shared pool
    (the kernels release the GIL)."""
    global _pool
    if not pieces:  # a layer without elements
        return
    if len(pieces) > 1 and _pool is None:
        with _pool_lock:
            _pool = _pool or ThreadPoolExecutor(available_cores(), "eps-lamb")
    rest = [_pool.submit(fn, *p) for p in pieces[1:]]
    fn(*pieces[0])
    for fut in rest:
        fut.result()


def _scratch(n: int) -> np.ndarray:
    """A float32 buffer of at least n elements, one per math thread, reused across updates
    (allocating a fresh one per update would page-fault it in every time)."""
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.shape[0] < n:
        buf = _local.scratch = np.empty(n, dtype=np.float32)
    return buf[:n]


OPTIMIZERS = {"adamw": AdamW, "lamb": Lamb, "sgd": Sgd}


def make_optimizer(plan: LayerPlan, master: torch.Tensor, grad: torch.Tensor,
                   compute: torch.Tensor | None, cfg: OptimizerConfig, **kw) -> LayerOptimizer:
    return OPTIMIZERS[cfg.name](plan, master, grad, compute, cfg, **kw)
