"""Plain PyTorch training of the assembled model: the reference L2L must reproduce."""

from __future__ import annotations

import torch

from worker.config import ModelConfig
from worker.data import Sharder, build_task
from worker.models import build_model
from worker.models.base import optimizer_groups


def train_resident(mcfg: ModelConfig, *, steps: int, global_micro_batches: int, batch_size: int,
                   lr: float = 1e-3, weight_decay: float = 0.01, optimizer: str = "adamw",
                   momentum: float = 0.0, skips=lambda step: frozenset(), device="cpu",
                   losses: list[float] | None = None, clip_norm: float = 0.0,
                   norms: list[float] | None = None) -> dict[str, torch.Tensor]:
    """All layers resident, gradient accumulation over the global micro-batches in order,
    one torch optimizer step per step; biases and norm scales without weight decay.
    ``skips(step)``: blocks that step leaves out (their parameters get no gradient, so torch's
    optimizer leaves them and their state alone). On CUDA: TF32 off (fp32 matmuls in full
    precision, as the workers run them); the weights come back on the CPU. ``losses``: each
    step's loss (summed over its micro-batches) is appended to it. ``clip_norm``: the global
    gradient norm clipped by ``clip_grad_norm_``, each step's norm appended to ``norms``."""
    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    net = build_model(mcfg).assemble().to(device).train()
    param_groups = optimizer_groups(net.named_parameters(), weight_decay)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(param_groups, lr=lr)
    else:
        opt = torch.optim.SGD(param_groups, lr=lr, momentum=momentum)
    sharder = Sharder(build_task(build_model(mcfg)), batch_size, global_micro_batches)
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for index, batch in enumerate(sharder.batches(step, range(global_micro_batches))):
            loss, _ = net(batch.to(device), rng=(mcfg.seed, step, index), skip=skips(step))
            loss.backward()
            if losses is not None:
                total += loss.item()
        if clip_norm:
            norm = torch.nn.utils.clip_grad_norm_(net.parameters(), clip_norm)
            if norms is not None:
                norms.append(float(norm))
        opt.step()
        if losses is not None:
            losses.append(total)
    return {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}


def assert_close(got: dict, want: dict, atol: float = 1e-5, rtol: float = 1e-4) -> float:
    """Every parameter within atol + rtol*|want|; returns the largest absolute difference."""
    assert set(got) == set(want), set(got) ^ set(want)
    worst = 0.0
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape, name
        diff = (g - w).abs()
        bad = diff > atol + rtol * w.abs()
        assert not bad.any(), (f"{name}: {int(bad.sum())} elements differ, max "
                               f"{diff.max().item():.3g}")
        worst = max(worst, diff.max().item())
    return worst


def train_local_l2l(mcfg: ModelConfig, *, steps: int, micro_batches: int, batch_size: int,
                    lr: float = 1e-3, data=None, layer_drop: float = 0.0, source=None,
                    activation_budget_gib: float = 0.0, executors: list | None = None
                    ) -> dict[str, torch.Tensor]:
    """The L2L executor in this process against weights held locally (bench.local.LocalSource,
    the same per-layer AdamW as the EPS): the loop without the server. ``source(model, layout,
    OptimizerConfig)``: another layer source, with the final weights in ``.flats``. Returns the
    assembled model's state dict names (a tied tensor under each of its names), or for an hf:
    model the checkpoint's names (each tensor once)."""
    from bench.local import LocalSource
    from eps_server.config import OptimizerConfig
    from protocol.tensors import named_views, plan_layout
    from worker.executor import Executor
    from worker.keep import GraphBudget

    model = build_model(mcfg)
    layout = plan_layout(model.manifest())
    source = (source or LocalSource)(model, layout, OptimizerConfig(lr=lr))
    task = build_task(model, data, micro_batch_size=batch_size, global_micro_batches=micro_batches)
    ex = Executor(model, layout, source, Sharder(task, batch_size, micro_batches),
                  device=torch.device("cpu"), micro_batches=range(micro_batches), steps=steps,
                  dropout=model.dropout, seed=mcfg.seed, layer_drop=layer_drop,
                  budget=GraphBudget(activation_budget_gib, torch.device("cpu")))
    if executors is not None:
        executors.append(ex)
    for step in range(steps):
        ex.run_step(step)
    named = [named_views(flat, plan) for plan, flat in zip(layout.layers, source.flats)]
    if hasattr(model, "family"):
        return {model.family.hf_name(plan.name, n): v
                for plan in layout.layers for n, v in named[plan.index].items()}
    out = {}
    for plan in layout.layers:
        out.update({f"{plan.name}.{n}": v for n, v in named[plan.index].items()})
        out.update({f"{plan.name}.{t.name}": named[t.owner][t.tensor] for t in plan.ties})
    return out
