"""Per-layer optimizers on flat fp32 buffers.

Each layer gets its own torch optimizer over (at most) two flat parameters, the "decay" and the
"no_decay" spans of its master (see protocol.tensors: each group is contiguous), with the
reducer's accumulator spans as their ``.grad``. So one fused kernel call updates a whole group,
and there is no Python loop over the model's tensors on the hot path.

State (exp_avg, exp_avg_sq, step) is allocated by torch on the first step, in this process:
zeros, exactly as a fresh torch optimizer would (no warm-up step on zero gradients).
"""

from __future__ import annotations

import torch

from protocol.tensors import LayerPlan

from .config import OptimizerConfig


class LayerOptimizer:
    def __init__(self, plan: LayerPlan, master: torch.Tensor, grad: torch.Tensor,
                 cfg: OptimizerConfig):
        self.plan = plan
        self.cfg = cfg
        groups = []
        for group, (start, end) in plan.groups.items():
            param = master[start:end]
            param.grad = grad[start:end]
            groups.append({"params": [param],
                           "weight_decay": cfg.weight_decay if group == "decay" else 0.0})
        self.params = [g["params"][0] for g in groups]
        if cfg.name == "adamw":
            self.opt: torch.optim.Optimizer = torch.optim.AdamW(
                groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
        else:
            self.opt = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, foreach=True)

    def step(self, lr: float) -> None:
        """One update of this layer from its reduced gradient (math thread)."""
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()

    # -- checkpoints ------------------------------------------------------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Flat name -> tensor map of this layer's optimizer state (for checkpoints)."""
        out = {}
        for i, p in enumerate(self.params):
            for key, value in self.opt.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"{i}.{key}"] = value
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for i, p in enumerate(self.params):
            state = {}
            prefix = f"{i}."
            for name, value in tensors.items():
                if name.startswith(prefix):
                    key = name[len(prefix):]
                    if key != "step" and value.shape != p.shape:
                        raise ValueError(f"optimizer state {name} of layer {self.plan.name} has "
                                         f"shape {tuple(value.shape)}, expected {tuple(p.shape)}")
                    state[key] = value.clone()
            if state:
                self.opt.state[p] = state
