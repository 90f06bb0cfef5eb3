"""Configuration of an l2l-worker: the model, the job, the execution."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.endpoints import default_endpoint

MODELS = ("bert", "gpt")
STASHES = ("device", "host", "eps")


@dataclass(kw_only=True)
class ModelConfig:
    """A layered transformer. ``layers`` counts the identical blocks; pre and post come on top."""

    model: str = "bert"
    """bert: post-LN encoder classifier on the planted-trigger task;
    gpt: pre-LN causal decoder LM on the synthetic Markov language."""
    layers: int = 4
    hidden: int = 64
    heads: int = 4
    ffn: int = 0
    """Feed-forward width; 0 means 4 x hidden."""
    seq_len: int = 32
    vocab: int = 128
    classes: int = 4
    """Number of classes (bert)."""
    dropout: float = 0.1
    seed: int = 0
    """Seeds initial weights, data and dropout (all pure functions of it)."""

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}")
        if self.layers < 1 or self.hidden < 1 or self.seq_len < 2:
            raise ValueError("layers, hidden must be >= 1 and seq_len >= 2")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if not 0 <= self.dropout < 1:
            raise ValueError("dropout must be in [0, 1)")
        if self.ffn == 0:
            self.ffn = 4 * self.hidden


@dataclass(kw_only=True)
class WorkerConfig:
    """One l2l-worker process (one device)."""

    endpoint: str = field(default_factory=default_endpoint)
    rank: int = 0
    world_size: int = 1
    device: str = "cpu"
    """cpu, cuda or cuda:K."""
    steps: int = 10
    """Train until the model has taken this many optimizer steps (a resumed server continues)."""
    micro_batches: int = 2
    """u: micro-batches per worker per step, all run through a layer per visit."""
    micro_batch_size: int = 8
    grad_dtype: str = "compute"
    """Dtype of pushed gradients: compute (the EPS's compute precision) or float32. Sums over
    micro-batches are always accumulated in fp32; the EPS reduces across workers in fp32."""
    transport: str = "shm"
    """shm: tensors through shared memory (same box); frames: tensor bytes over ZeroMQ."""
    stash: str = "device"
    """Where boundary activations live between forward and backward: device, host (pinned
    host memory; the device itself on CPU) or eps (EPS-owned shared memory)."""
    copy_weights: bool = False
    """On CPU, copy each layer into worker buffers instead of reading shared memory in place
    (what CUDA does; for tests and measurements)."""
    trace: str = ""
    """Write a Chrome/Perfetto trace of this worker here."""
    overlap: bool = True
    """L2Lp: prefetch the next layer and push gradients asynchronously. False runs the same
    loop with every fetch and push waited for in turn (for comparison)."""
    threads: int = 1
    """torch intra-op threads of this process."""
    eps_timeout: float = 600.0
    """Seconds to wait for any single EPS reply before giving up."""
    save: str = ""
    """Rank 0 writes the trained model (safetensors, assembled nn.Module names) here."""
    summary_json: str = ""
    """This worker's summary (losses, throughput, peak memory)."""
    events: bool = True
    """Print one ``L2L_EVENT {json}`` line per step on stdout (read by l2l-launch)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError("rank must be in [0, world_size)")
        if self.micro_batches < 1 or self.micro_batch_size < 1 or self.steps < 0:
            raise ValueError("micro_batches and micro_batch_size must be >= 1, steps >= 0")
        if self.grad_dtype not in ("compute", "float32"):
            raise ValueError("grad_dtype must be compute or float32")
        if self.transport not in ("shm", "frames"):
            raise ValueError("transport must be shm or frames")
        if self.stash not in STASHES:
            raise ValueError(f"stash must be one of {STASHES}")

    @property
    def global_micro_batches(self) -> int:
        return self.world_size * self.micro_batches

    def my_micro_batches(self) -> range:
        """Global indices of this worker's micro-batches: rank r has [r*u, (r+1)*u)."""
        return range(self.rank * self.micro_batches, (self.rank + 1) * self.micro_batches)
