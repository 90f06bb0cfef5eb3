"""Configuration of the Eager Param-Server, one kw-only dataclass per component."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, replace

from protocol.endpoints import default_endpoint

from .schedules import SCHEDULES, lr_at

PRECISIONS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
OPTIMIZERS = ("adamw", "lamb", "sgd")
UPDATES = ("eager", "deferred")


@dataclass(kw_only=True)
class OptimizerConfig:
    """Per-layer optimizer run by the EPS on the fp32 master."""

    name: str = "adamw"
    """adamw (torch's fused kernel), lamb (per-tensor trust ratio) or sgd (momentum)."""
    lr: float = 1e-3
    """Base learning rate (the schedule scales it)."""
    weight_decay: float = 0.01
    """Decoupled weight decay for the "decay" group; the "no_decay" group (biases, norms) gets 0."""
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    momentum: float = 0.0
    """SGD momentum."""
    schedule: str = "constant"
    """Learning-rate schedule after warm-up: constant, linear or cosine (see schedules.py)."""
    warmup_steps: int = 0
    total_steps: int = 0
    """Where linear/cosine decay reaches ``min_lr_ratio`` x lr."""
    min_lr_ratio: float = 0.0
    clip_norm: float = 0.0
    """Gradient clipping (0: off). Eager updates clip each layer's gradient norm; deferred
    updates clip the global norm over all layers (as torch.nn.utils.clip_grad_norm_)."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.name!r}")
        for key, value in asdict(self).items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{key} must be finite")
        if not self.lr >= 0 or not self.weight_decay >= 0 or not self.eps > 0:
            raise ValueError("lr and weight_decay must be >= 0, eps > 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and 0 <= self.momentum < 1):
            raise ValueError("beta1, beta2 and momentum must be in [0, 1)")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}")
        if self.schedule != "constant" and self.total_steps <= self.warmup_steps:
            raise ValueError("a decaying schedule needs total_steps > warmup_steps")
        if self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1 or not self.clip_norm >= 0:
            raise ValueError("warmup_steps >= 0, min_lr_ratio in [0, 1], clip_norm >= 0")

    def lr_at(self, t: int) -> float:
        """Learning rate of update t."""
        return lr_at(t, self.lr, self.schedule, self.warmup_steps, self.total_steps,
                     self.min_lr_ratio)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(kw_only=True)
class ServerConfig:
    """The eps-server process."""

    endpoint: str = field(default_factory=default_endpoint)
    """ZeroMQ endpoint to bind: ipc:///path (default, per-user 0700 dir) or tcp://127.0.0.1:P."""
    world_size: int = 1
    """Number of workers whose gradients make up one step."""
    precision: str = "fp32"
    """Compute precision served to workers: fp32 | bf16 | fp16. The master is always fp32."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    threads: int = 1
    """Threads for reduction and update (torch intra-op threads and the math thread pool)."""
    grad_slots: int = 2
    """Gradient slots per worker in shared memory (layers whose reduction may be in flight)."""
    run_id: str = ""
    """Names this run's shared-memory regions (l2l-<run_id>-...); random when empty."""
    load: str = ""
    """Checkpoint directory to resume from (manifest, master, optimizer state, step)."""
    save: str = ""
    """Checkpoint directory written when the server exits cleanly."""
    checkpoint_every: int = 0
    """Also save to ``save`` every N completed steps (0: only at exit)."""
    exit_when_done: bool = False
    """Exit once all world_size workers said Bye(done=True)."""
    trace: str = ""
    """Write a Chrome/Perfetto trace (reduce, update, checkpoint spans) here at exit."""
    update: str = "eager"
    """eager: update each layer as soon as its gradient is reduced (L2Lp overlap; clipping and
    fp16 overflow skips are per layer). deferred: update after the step's last layer arrives,
    with exact global semantics (global-norm clipping, whole-step overflow skip, as in AMP)."""
    loss_scale: float = 2.0 ** 16
    """fp16 only: initial dynamic loss scale."""
    loss_scale_window: int = 1000
    """fp16 only: double the scale after this many steps without overflow; halve on one."""

    def __post_init__(self) -> None:
        if not 1 <= self.world_size <= 4096:
            raise ValueError("world_size must be in [1, 4096]")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}")
        if self.threads < 1 or self.grad_slots < 1:
            raise ValueError("threads and grad_slots must be >= 1")
        if self.update not in UPDATES:
            raise ValueError(f"update must be one of {UPDATES}")
        if not self.loss_scale > 0 or self.loss_scale_window < 1:
            raise ValueError("loss_scale must be > 0 and loss_scale_window >= 1")
        if self.checkpoint_every and not self.save:
            raise ValueError("checkpoint_every needs a save path")
        if self.run_id and not re.fullmatch(r"[A-Za-z0-9_]{1,64}", self.run_id):
            raise ValueError("run_id must be 1..64 letters, digits or underscores")

    @property
    def compute_dtype(self) -> str:
        return PRECISIONS[self.precision]

    @property
    def loss_scaling(self) -> bool:
        """Dynamic loss scaling is on for fp16 compute (bf16 has fp32's range)."""
        return self.precision == "fp16"


# Hyperparameters a running server accepts in SetHyper (the rest would change state layout).
MUTABLE = ("lr", "weight_decay", "beta1", "beta2", "eps", "momentum", "schedule",
           "warmup_steps", "total_steps", "min_lr_ratio", "clip_norm")


def with_changes(cfg: OptimizerConfig, changes: dict) -> OptimizerConfig:
    """A copy of ``cfg`` with ``changes`` applied; ValueError names what is not allowed."""
    bad = sorted(set(changes) - set(MUTABLE))
    if bad:
        raise ValueError(f"cannot change {', '.join(bad)} at run time; changeable: "
                         f"{', '.join(MUTABLE)}")
    typed = {}
    for key, value in changes.items():
        want = type(getattr(cfg, key))
        if want is float and type(value) in (int, float):
            value = float(value)
        if type(value) is not want:
            raise ValueError(f"{key} must be a {want.__name__}")
        typed[key] = value
    new = replace(cfg, **typed)
    if (cfg.momentum == 0) != (new.momentum == 0):
        raise ValueError("momentum cannot be switched on or off at run time")
    return new
