"""Configuration of the Eager Param-Server, one kw-only dataclass per component."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from protocol.endpoints import default_endpoint

PRECISIONS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
OPTIMIZERS = ("adamw", "sgd")


@dataclass(kw_only=True)
class OptimizerConfig:
    """Per-layer optimizer run by the EPS on the fp32 master."""

    name: str = "adamw"
    """adamw (torch fused kernel) or sgd (torch foreach kernel)."""
    lr: float = 1e-3
    """Learning rate."""
    weight_decay: float = 0.01
    """Decoupled weight decay for the "decay" group; the "no_decay" group (biases, norms) gets 0."""
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    momentum: float = 0.0
    """SGD momentum."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.name!r}")
        if not self.lr >= 0:
            raise ValueError("lr must be >= 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError("betas must be in [0, 1)")

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

    def __post_init__(self) -> None:
        if not 1 <= self.world_size <= 4096:
            raise ValueError("world_size must be in [1, 4096]")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}")
        if self.threads < 1 or self.grad_slots < 1:
            raise ValueError("threads and grad_slots must be >= 1")
        if self.checkpoint_every and not self.save:
            raise ValueError("checkpoint_every needs a save path")
        if self.run_id and not re.fullmatch(r"[A-Za-z0-9_]{1,64}", self.run_id):
            raise ValueError("run_id must be 1..64 letters, digits or underscores")

    @property
    def compute_dtype(self) -> str:
        return PRECISIONS[self.precision]
