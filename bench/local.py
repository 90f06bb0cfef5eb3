"""In-process baselines: plain resident training, resident with per-layer activation
checkpointing, and the *same* L2L executor with every weight already local and the optimizer
run in-process (``LocalSource``) — the reference that isolates L2Lp's exposed overhead."""

from __future__ import annotations

import torch

from eps_server.config import OptimizerConfig
from eps_server.optimizers import make_optimizer
from protocol.tensors import LayerPlan, Layout, plan_layout
from worker.config import ModelConfig
from worker.data import Sharder, build_task
from worker.executor import Executor
from worker.models import build_model
from worker.models.base import optimizer_groups

from .common import timed_steps


class LocalSource:
    """A layer source with all weights resident and the optimizer run in-process, right after
    each layer's backward (the same eager per-layer update as the EPS, without overlap)."""

    def __init__(self, model, layout: Layout, opt: OptimizerConfig, device="cpu"):
        self.flats = [model.init_flat(p.index, p).to(device) for p in layout.layers]
        self.grads = [torch.zeros(p.numel, device=device) for p in layout.layers]
        self.opts = [make_optimizer(p, f, None, opt) for p, f in
                     zip(layout.layers, self.flats)]
        self.lr = opt.lr

    def prefetch(self, layer: int, version: int) -> None:
        pass

    def weights(self, layer: int, version: int) -> torch.Tensor:
        return self.flats[layer]

    def release(self, layer: int, version: int) -> None:
        pass

    def grad_buffer(self, plan: LayerPlan):
        return 0, self.grads[plan.index]  # padding is never written: stays zero

    def push(self, step: int, plan: LayerPlan, slot: int, buf: torch.Tensor) -> None:
        self.opts[plan.index].step((self.grads[plan.index],), step, lr=self.lr)

    def skip(self, step: int, plan: LayerPlan) -> None:
        pass  # no gradient, no update: as torch's optimizers treat a parameter without grad

    def drain(self) -> None:
        pass

    def loss_scale(self, version: int) -> float:
        return 1.0

    def tick(self) -> None:
        pass

    def redo(self, step: int, layers) -> None:
        pass  # nothing is pushed twice in-process

    def stash_arena(self, nbytes: int):
        raise RuntimeError("the local baseline has no EPS stash")

    def release_arena(self, region) -> None:
        pass


def local_executor(mcfg: ModelConfig, *, micro_batches: int, batch_size: int, steps: int,
                   lr: float = 1e-3, device="cpu") -> Executor:
    """The L2L executor of ``mcfg``'s model against a LocalSource, for ``steps`` steps."""
    model = build_model(mcfg)
    layout = plan_layout(model.manifest())
    source = LocalSource(model, layout, OptimizerConfig(lr=lr), device)
    sharder = Sharder(build_task(build_model(mcfg)), batch_size, micro_batches)
    return Executor(model, layout, source, sharder, device=torch.device(device),
                    micro_batches=range(micro_batches), steps=steps, dropout=model.dropout,
                    seed=mcfg.seed)


def local_l2l_step_seconds(mcfg: ModelConfig, *, micro_batches: int, batch_size: int,
                           steps: int, warmup: int, lr: float = 1e-3, device="cpu") -> float:
    ex = local_executor(mcfg, micro_batches=micro_batches, batch_size=batch_size,
                        steps=warmup + steps, lr=lr, device=device)
    return timed_steps(ex.run_step, steps, warmup, device)


def resident_step_seconds(mcfg: ModelConfig, *, micro_batches: int, batch_size: int,
                          steps: int, warmup: int, checkpoint: bool, lr: float = 1e-3,
                          device="cpu", data=None) -> float:
    """All layers resident, gradient accumulation over the micro-batches, fused AdamW
    (``data``: the DataConfig a Hugging Face model reads)."""
    net = build_model(mcfg).assemble().train().to(device)
    opt = torch.optim.AdamW(optimizer_groups(net.named_parameters(), 0.01), lr=lr, fused=True)
    sharder = Sharder(build_task(build_model(mcfg), data, micro_batch_size=batch_size,
                                 global_micro_batches=micro_batches), batch_size, micro_batches)

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=False)
        for index, batch in enumerate(sharder.batches(i, range(micro_batches))):
            loss, _ = net(batch.to(torch.device(device)), rng=(mcfg.seed, i, index),
                          checkpoint=checkpoint)
            loss.backward()
        opt.step()

    return timed_steps(step, steps, warmup, device)
