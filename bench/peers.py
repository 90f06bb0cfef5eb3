"""What users compare l2l with on one GPU: the same assembled model (same micro-batches, same
global batch, AdamW) trained as each system's users run it:

    resident    the whole model on the GPU: fp32 master, bf16 autocast, fused AdamW, gradient
                accumulation, no activation checkpointing (where it fits)
    fsdp2       PyTorch FSDP2, fully_shard per block and the root, CPUOffloadPolicy (parameters,
                gradients and AdamW on the host; each block gathered to the GPU for its
                forward, its recompute and its backward, for every micro-batch), one process,
                fused CPU AdamW (fused=True, as a PyTorch user passes), per-block activation
                checkpointing, gradient accumulation as FSDP2 offers it
                (set_requires_gradient_sync(False) but for the last micro-batch: the sum is
                kept on the GPU in fp32, reduced and offloaded once a step)
    fsdp2-noac  the same without activation checkpointing
    fsdp2-hostacc  fsdp2 with every micro-batch's gradient reduced and offloaded, summed in
                host memory (device memory flat in the micro-batches; FSDP2 then copies each
                gradient out synchronously and adds it on the CPU inside the backward)
    deepspeed  DeepSpeed ZeRO-3 with parameter and optimizer offload to the CPU
               (DeepSpeedCPUAdam, built at first use), if it is installed: for models whose
               parameters do not fit the device
    deepspeed-offload  ZeRO-Offload as its users run a model whose bf16 parameters fit: ZeRO-2,
               the optimizer (fp32 master, AdamW state) offloaded to DeepSpeedCPUAdam

(``data``: the data file a Hugging Face model reads; the built-in ones make their own.)
They train with AdamW (by default lr 1e-4, weight decay 0.01 on matrices only, as l2l's EPS)
on the sum of the micro-batches' gradients. Each returns samples/s, peak device memory and every
step's loss (summed over its micro-batches). On a CPU (tiny models, --tiny) they check the
harness: FSDP2 runs without offload on gloo; DeepSpeed where its accelerator is the CPU (no
CUDA device, or DS_ACCELERATOR=cpu) with the same ZeRO-3 configuration and its CPU Adam (the
"offload" is then from host memory to host memory).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch import nn

from worker.config import DataConfig, ModelConfig
from worker.data import Sharder, build_task
from worker.models import build_model
from worker.models.base import optimizer_groups

from .common import free_port, timed_steps

LR, WEIGHT_DECAY = 1e-4, 0.01


def _task(mcfg: ModelConfig, data: DataConfig | None, batch_size: int, micro_batches: int):
    return build_task(build_model(mcfg), data, micro_batch_size=batch_size,
                      global_micro_batches=micro_batches)


def missing(name: str) -> str:
    """Why peer ``name`` cannot run here ("" if it can), without importing it."""
    if name not in PEERS:
        return f"unknown peer (peers: {', '.join(PEERS)})"
    module = ("torch.distributed.fsdp" if name.startswith("fsdp2") else
              "deepspeed" if name.startswith("deepspeed") else "torch")
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    return "" if found else f"{module} is not installed"


def _peak(device: torch.device) -> int:
    from worker.memory import private_rss

    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else private_rss()


def resident(mcfg: ModelConfig, *, micro_batches: int, batch_size: int, steps: int,
             warmup: int, device: str, precision: str, lr: float = LR,
             weight_decay: float = WEIGHT_DECAY, data: DataConfig | None = None) -> dict:
    dev = torch.device(device)
    layered = build_model(mcfg)
    if precision == "bf16" and getattr(layered, "config", None) is not None and getattr(
            layered.config, "_experts_implementation", None):
        # a mixture of experts: the library's grouped matmul casts its input to the weights'
        # dtype (autocast does not reach it), so with fp32 master weights it would compute
        # the experts in fp32; its eager experts (a linear each) autocast computes in bf16
        layered.config._experts_implementation = "eager"
    net = layered.assemble().train().to(dev)
    opt = torch.optim.AdamW(optimizer_groups(net.named_parameters(), weight_decay), lr=lr,
                            fused=True)
    sharder = Sharder(_task(mcfg, data, batch_size, micro_batches), batch_size, micro_batches)
    losses: list[float] = []
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def step(i: int) -> None:
        total = torch.zeros((), device=dev)
        for index, batch in enumerate(sharder.batches(i, range(micro_batches))):
            with autocast:
                loss, _ = net(batch.to(dev), rng=(mcfg.seed, i, index), checkpoint=False)
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        losses.append(total.item())

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    seconds = timed_steps(step, steps, warmup, dev)
    return {"samples_per_sec": micro_batches * batch_size / seconds, "step_seconds": seconds,
            "peak_bytes": int(_peak(dev)), "losses": losses}


def fsdp2(mcfg: ModelConfig, *, micro_batches: int, batch_size: int, steps: int, warmup: int,
          device: str, precision: str, lr: float = LR, weight_decay: float = WEIGHT_DECAY,
          checkpoint: bool = True, host_accumulation: bool = False,
          data: DataConfig | None = None) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )
    except ImportError:  # torch < 2.6 keeps FSDP2 here
        from torch.distributed._composable.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo",
                            init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        mesh = init_device_mesh(dev.type, (1,))
        net = build_model(mcfg).assemble().train()
        kw = dict(mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=True) if cuda
                  else OffloadPolicy(),
                  mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32)
                  if precision == "bf16" else MixedPrecisionPolicy())
        for block in net.blocks:
            fully_shard(block, **kw)
        fully_shard(net, **kw)
        opt = torch.optim.AdamW(optimizer_groups(net.named_parameters(), weight_decay), lr=lr,
                                fused=True)
        sharder = Sharder(_task(mcfg, data, batch_size, micro_batches), batch_size, micro_batches)
        losses: list[float] = []

        def step(i: int) -> None:
            total = torch.zeros((), device=dev)
            for index, batch in enumerate(sharder.batches(i, range(micro_batches))):
                net.set_requires_gradient_sync(host_accumulation or index == micro_batches - 1)
                loss, _ = net(batch.to(dev), rng=(mcfg.seed, i, index), checkpoint=checkpoint)
                loss.backward()
                total += loss.detach()
            opt.step()
            opt.zero_grad()
            losses.append(total.item())  # the step's end: timed_steps synchronizes there too

        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        seconds = timed_steps(step, steps, warmup, dev)
        return {"samples_per_sec": micro_batches * batch_size / seconds,
                "step_seconds": seconds, "peak_bytes": int(_peak(dev)),
                "offload": "CPUOffloadPolicy" if cuda else "none (CPU)", "losses": losses}
    finally:
        dist.destroy_process_group()


class _Loss(nn.Module):
    """DeepSpeed's engine calls the model with the batch and back-propagates what it returns."""

    def __init__(self, net: nn.Module, seed: int):
        super().__init__()
        self.net, self.seed = net, seed

    def forward(self, batch, rng):
        return self.net(batch, rng=rng, checkpoint=True)[0]


def deepspeed(mcfg: ModelConfig, *, micro_batches: int, batch_size: int, steps: int,
              warmup: int, device: str, precision: str, lr: float = LR,
              weight_decay: float = WEIGHT_DECAY, stage: int = 3,
              data: DataConfig | None = None) -> dict:
    env = dict(os.environ)  # (importing DeepSpeed, and its engine, set variables of their own)
    import deepspeed as ds  # an ImportError says it is not installed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    dev = torch.device(device)
    if get_accelerator().device_name() != dev.type:
        _restore(env)
        raise RuntimeError(f"DeepSpeed's accelerator is {get_accelerator().device_name()!r}, "
                           f"not {dev.type!r}: ZeRO-3 offload needs CUDA, or DS_ACCELERATOR=cpu "
                           "on a CPU")
    config = {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": micro_batches,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": weight_decay}},
        "zero_optimization": {"stage": stage,
                              "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              **({"offload_param": {"device": "cpu", "pin_memory": True}}
                                 if stage == 3 else {})},
        "bf16": {"enabled": precision == "bf16"},
        "steps_per_print": 1 << 30,
    }
    net = _Loss(build_model(mcfg).assemble().train(), mcfg.seed)
    os.environ.update(RANK="0", LOCAL_RANK=str(dev.index or 0), WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    engine = None
    try:
        engine, _, _, _ = ds.initialize(
            model=net, config=config,
            model_parameters=optimizer_groups(net.named_parameters(), weight_decay))
        sharder = Sharder(_task(mcfg, data, batch_size, micro_batches), batch_size, micro_batches)
        losses: list[float] = []

        def step(i: int) -> None:
            total = torch.zeros((), device=dev)
            for index, batch in enumerate(sharder.batches(i, range(micro_batches))):
                loss = engine(batch.to(dev), (mcfg.seed, i, index))
                engine.backward(loss, scale_wrt_gas=False)  # summed, as the others do
                engine.step()  # updates once every gradient_accumulation_steps calls
                total += loss.detach()
            losses.append(total.item())

        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        seconds = timed_steps(step, steps, warmup, dev)
        return {"samples_per_sec": micro_batches * batch_size / seconds,
                "step_seconds": seconds, "peak_bytes": int(_peak(dev)),
                "version": ds.__version__, "losses": losses}
    finally:  # nothing of the run stays in this process (a test's, or the next peer's)
        if engine is not None and hasattr(engine, "destroy"):  # DeepSpeed >= 0.14
            engine.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()
        _forget_groups()
        _restore(env)


def _restore(env: dict) -> None:
    """The environment as it was: the variables set since removed, the ones changed put back."""
    for k in set(os.environ) - set(env):
        del os.environ[k]
    os.environ.update(env)


def _forget_groups() -> None:
    """DeepSpeed keeps the process groups it made in module globals (utils/groups.py): once
    the group is destroyed, the next engine in this process would use the dead ones."""
    from deepspeed.utils import groups

    for name, value in list(vars(groups).items()):
        if name.startswith("_") and name.endswith(("_GROUP", "_GROUPS")) and value is not None:
            setattr(groups, name, {} if isinstance(value, dict) else None)


PEERS = {"resident": resident, "fsdp2": fsdp2,
         "fsdp2-noac": functools.partial(fsdp2, checkpoint=False),
         "fsdp2-hostacc": functools.partial(fsdp2, host_accumulation=True), "deepspeed": deepspeed,
         "deepspeed-offload": functools.partial(deepspeed, stage=2)}
