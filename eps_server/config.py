"""Configuration of the Eager Param-Server, one kw-only dataclass per component.

Each field's docstring is its --help text (``protocol.cli`` builds eps-server's and
l2l-launch's options from these classes); ``__post_init__`` validates.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

from protocol.endpoints import default_endpoint, is_loopback_host
from protocol.shm import is_run_id

from .schedules import lr_at

PRECISIONS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


MAX_LR = 100.0
MAX_STEPS = 2**31 - 1


@dataclass(kw_only=True)
class OptimizerConfig:
    """Per-layer optimizer run by the EPS on the fp32 master."""

    name: Literal["adamw", "lamb", "sgd"] = field(default="adamw",
                                                  metadata={"flag": "--optimizer"})
    """adamw (torch's fused kernel), lamb (per-tensor trust ratio) or sgd (momentum)."""
    lr: float = 1e-3
    """Base learning rate (the schedule scales it)."""
    weight_decay: float = 0.01
    """Decoupled (AdamW, LAMB) or L2 (SGD) weight decay; biases and norms get none."""
    beta1: float = 0.9
    """AdamW/LAMB: decay rate of the first-moment (mean) estimate."""
    beta2: float = 0.999
    """AdamW/LAMB: decay rate of the second-moment (variance) estimate."""
    eps: float = field(default=1e-8, metadata={"flag": "--adam-eps"})
    """AdamW/LAMB: added to the root of the second moment, for numerical stability."""
    momentum: float = 0.0
    """SGD momentum (0: plain SGD; fixed for the run)."""
    schedule: Literal["constant", "linear", "cosine"] = field(
        default="constant", metadata={"flag": "--lr-schedule"})
    """Learning-rate schedule after the warm-up: constant, linear or cosine decay."""
    warmup_steps: int = 0
    """Linear warm-up over this many updates (steps)."""
    total_steps: int = 0
    """Step at which a linear/cosine decay reaches min_lr_ratio x lr."""
    min_lr_ratio: float = 0.0
    """Floor of the decay, as a fraction of lr."""
    clip_norm: float = 0.0
    """Clip the global gradient norm over all layers to this (0: off), as
    torch.nn.utils.clip_grad_norm_, with eager updates too (speculative, rolled back when the
    norm turns out above it)."""
    states: Literal["fp32", "bf16"] = field(default="fp32",
                                            metadata={"flag": "--optimizer-states"})
    """AdamW's and LAMB's moments m, v: fp32, or bf16 with stochastic rounding (4 bytes per
    parameter less; the master stays fp32). Fixed for the run; a checkpoint of the other
    kind is converted when loaded."""

    def __post_init__(self) -> None:
        if self.name not in ("adamw", "lamb", "sgd"):
            raise ValueError(f"optimizer must be adamw, lamb or sgd, got {self.name!r}")
        for key, value in asdict(self).items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{key} must be finite")
        # Upper bounds catch typos (lr=1e30 blows the weights up in one update; a warm-up of
        # 2^62 steps leaves lr at 1e-19 for good), also in l2l-ctl set on a running job.
        if not 0 <= self.lr <= MAX_LR or not 0 <= self.weight_decay <= MAX_LR or \
                not 0 < self.eps <= 1:
            raise ValueError(f"lr and weight_decay must be in [0, {MAX_LR:g}], eps in (0, 1]")
        if not 0 <= self.warmup_steps <= MAX_STEPS or not 0 <= self.total_steps <= MAX_STEPS:
            raise ValueError(f"warmup_steps and total_steps must be in [0, {MAX_STEPS}]")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and 0 <= self.momentum < 1):
            raise ValueError("beta1, beta2 and momentum must be in [0, 1)")
        if self.schedule not in ("constant", "linear", "cosine"):
            raise ValueError("schedule must be constant, linear or cosine")
        if self.schedule != "constant" and self.total_steps <= self.warmup_steps:
            raise ValueError("a decaying schedule needs total_steps > warmup_steps")
        if not 0 <= self.min_lr_ratio <= 1 or not self.clip_norm >= 0:
            raise ValueError("min_lr_ratio must be in [0, 1], clip_norm >= 0")
        if self.states not in ("fp32", "bf16"):
            raise ValueError(f"optimizer states must be fp32 or bf16, got {self.states!r}")

    def lr_at(self, t: int) -> float:
        """Learning rate of update t."""
        return lr_at(t, self.lr, self.schedule, self.warmup_steps, self.total_steps,
                     self.min_lr_ratio)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(kw_only=True)
class BoxesConfig:
    """A job over several machines ("boxes"): one EPS per box with its local workers, the EPSes
    joined in a torch.distributed (gloo) process group by the env:// rendezvous contract."""

    nodes: int = 1
    """Boxes in the job (each runs one EPS and its workers); 1: this box alone."""
    node_rank: int = 0
    """This box's rank in [0, nodes): its workers take global ranks node_rank*W .. +W-1."""
    master_addr: str = "127.0.0.1"
    """Box 0's address for the rendezvous (MASTER_ADDR). gloo has no authentication: a
    non-loopback address needs --insecure (a private network between the boxes)."""
    master_port: int = 29500
    """Box 0's rendezvous port (MASTER_PORT)."""
    box_timeout: float = 60.0
    """Seconds a cross-box reduction (or the rendezvous) may wait for the other boxes: a box
    that dies or is cut off fails the job on every other box within this bound."""
    box_check_every: int = 50
    """Compare the replicas' checksums across boxes every K steps (0: never); a difference
    stops the job."""
    eps_mode: Literal["replicate", "shard"] = "replicate"
    """replicate: every box holds the master and optimizer state of every layer (gradients
    all-reduced, every box updates). shard: ZeRO-1 across the boxes, each holds 1/N of every
    layer's master and optimizer state (gradients reduce-scattered, each box updates its
    shard, the served copy all-gathered); checkpoints are then written by every box together
    into one --server-save folder that every box sees (a shared file system)."""
    rendezvous: Literal["tcp", "env"] = "tcp"
    """tcp: box 0 serves the rendezvous on master_addr:master_port; env: torch.distributed's
    env:// from the environment (under torchrun, its agent's store; l2l-launch sets this
    when it finds torchrun's variables)."""

    @property
    def sharding(self):
        """This box's part of every layer (shards.Sharding), or None (replicate, one box)."""
        from protocol.shards import Sharding

        sharded = self.nodes > 1 and self.eps_mode == "shard"
        return Sharding(self.node_rank, self.nodes) if sharded else None

    def __post_init__(self) -> None:
        if self.rendezvous == "env":  # torch reads them there: the checks and logs must too
            self.master_addr = os.environ.get("MASTER_ADDR", self.master_addr)
            port = os.environ.get("MASTER_PORT", "")
            self.master_port = int(port) if port.isdigit() else self.master_port
        if not 1 <= self.nodes <= 1024 or not 0 <= self.node_rank < self.nodes:
            raise ValueError("nodes must be in [1, 1024] and node_rank in [0, nodes)")
        if not 1 <= self.master_port <= 65535:
            raise ValueError("master_port must be in [1, 65535]")
        if not 1 <= self.box_timeout <= 86400 or self.box_check_every < 0:
            raise ValueError("box_timeout must be in [1, 86400] s, box_check_every >= 0")


@dataclass(kw_only=True)
class ServerConfig:
    """The eps-server process."""

    endpoint: str = field(default_factory=default_endpoint)
    """ZeroMQ endpoint to bind: ipc:///path (per-user 0700 directory) or tcp://HOST:PORT
    (loopback, or any address with CURVE or --insecure)."""
    curve_secret_key: str = ""
    """CURVE: this EPS's secret key file (NAME.key_secret from l2l-ctl keygen); with
    --curve-clients, every peer must prove it holds an allowed key."""
    curve_clients: str = ""
    """CURVE: a directory of the public key files (*.key) of the clients allowed to connect
    (read at start)."""
    insecure: bool = False
    """Allow tcp on a non-loopback address without CURVE: anyone who can reach the port can
    read the model and steer training (a warning is logged)."""
    world_size: int = 1
    """Number of workers whose gradients make up one step."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute precision served to the workers. The master and optimizer state are fp32."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    boxes: BoxesConfig = field(default_factory=BoxesConfig)
    update: Literal["eager", "deferred"] = "eager"
    """eager: update each layer as soon as its gradient is in (L2Lp overlap; with --clip-norm
    or fp16 the update is speculative and rolled back if the step's global norm clips or a
    gradient overflows). deferred: update once the step's last layer arrives. Both give the
    same global semantics (global-norm clipping, whole-step overflow skip, as in AMP)."""
    loss_scale: float = 2.0 ** 16
    """fp16 only: initial dynamic loss scale."""
    loss_scale_window: int = 1000
    """fp16 only: double the scale after this many steps without overflow (halve on one)."""
    threads: int = field(default=0, metadata={"flag": "--server-threads"})
    """The EPS's math threads: one pool running the pieces of every layer's passes (checks,
    updates), so a layer alone has all of them. 0: the cores this process may use
    (l2l-launch: less its workers' --threads)."""
    grad_slots: int = 2
    """Gradient slots per worker in shared memory (layers whose gradient may be pushed and not
    yet read by its update)."""
    peer_requests: int = 256
    """Requests one connection may have waiting for a reply (Fetches of a version not there
    yet, gradients held for their update, checkpoints); more are refused with "busy"."""
    heartbeat_timeout: float = 10.0
    """A registered peer that sends nothing (workers send a Heartbeat every timeout/4) for
    this many seconds is declared dead: its rank is freed for a replacement."""
    recovery: bool = False
    """Keep the previous version of every layer updated during a step that some worker has
    not finished, so a worker replacing a dead one redoes that step exactly (+4 bytes per
    parameter of shared memory in fp32, +2 in bf16/fp16; l2l-launch --max-restarts sets it)."""
    metrics_port: int = 0
    """Serve Prometheus metrics on this port (http://HOST:PORT/metrics; 0: off)."""
    metrics_host: str = "127.0.0.1"
    """Address of the metrics endpoint (a non-loopback one needs --insecure)."""
    run_id: str = ""
    """Names this run's shared-memory regions (l2l-<run_id>-...); random when empty."""
    load: str = ""
    """Checkpoint directory to resume from (manifest, master, optimizer state, step)."""
    save: str = field(default="", metadata={"flag": "--server-save"})
    """Checkpoint root: a checkpoint is written under it when the server exits cleanly (and
    every --checkpoint-every steps); --load takes the root (its latest) or one checkpoint."""
    checkpoint_every: int = 0
    """Also checkpoint to --server-save every N completed steps (0: only at exit)."""
    keep_checkpoints: int = 1
    """Checkpoints kept under --server-save: the newest K (older ones are removed once a newer
    one is complete)."""
    model_options: str = ""
    """The job's model options as a JSON map (l2l-launch gives its --model options), opaque to
    the EPS: recorded in each checkpoint (state.json "model"), so that l2l-export needs no
    model options; empty: those of the checkpoint loaded, if it has them."""
    job_options: str = ""
    """The workers' settings every box of a job must share, as a JSON map (l2l-launch gives
    steps, micro-batches and their size, LayerDrop, the data's format): with several boxes,
    compared at the join with the EPS's own and the model options (eps_server/box_settings.py);
    opaque otherwise."""
    exit_when_done: bool = False
    """Exit once all world_size workers said Bye(done=True) and the last updates are in."""
    trace: str = ""
    """Write a Chrome/Perfetto trace (reduce, update, checkpoint spans) here at exit."""
    events: str = ""
    """Write typed events (ready, final statistics) as JSON lines here: a file path, or fd:N
    for a pipe inherited from l2l-launch."""
    log_level: str = "INFO"
    """Log level on stderr (DEBUG, INFO, WARNING, ERROR)."""

    def __post_init__(self) -> None:
        if not 1 <= self.world_size <= 4096:
            raise ValueError("world_size must be in [1, 4096]")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}")
        if self.threads < 0 or self.grad_slots < 1 or self.peer_requests < 1:
            raise ValueError("threads must be >= 0, grad_slots and peer_requests >= 1")
        if self.update not in ("eager", "deferred"):
            raise ValueError("update must be eager or deferred")
        if not self.loss_scale > 0 or self.loss_scale_window < 1:
            raise ValueError("loss_scale must be > 0 and loss_scale_window >= 1")
        if self.keep_checkpoints < 1:
            raise ValueError("keep_checkpoints must be >= 1")
        if self.checkpoint_every < 0 or (self.checkpoint_every and not self.save):
            raise ValueError("checkpoint_every needs a save path (--server-save)")
        if not 0.1 <= self.heartbeat_timeout <= 86400:
            raise ValueError("heartbeat_timeout must be in [0.1, 86400] seconds")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError("metrics_port must be in [0, 65535]")
        if self.metrics_port and not (is_loopback_host(self.metrics_host) or self.insecure):
            raise ValueError(f"metrics on {self.metrics_host} (not loopback) would expose the "
                             "run to anyone who can reach it; give --insecure to allow it")
        if bool(self.curve_secret_key) != bool(self.curve_clients):
            raise ValueError("CURVE needs both curve_secret_key and curve_clients")
        if self.run_id and not is_run_id(self.run_id):
            raise ValueError("run_id must be 1..64 letters, digits or underscores")
        for name in ("model_options", "job_options"):
            try:
                ok = not getattr(self, name) or isinstance(json.loads(getattr(self, name)), dict)
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"{name} must be a JSON map")
        b = self.boxes
        if b.nodes > 1 and b.eps_mode == "shard" and self.optimizer.name == "lamb":
            raise ValueError("--eps-mode shard splits tensors across boxes and LAMB's trust "
                             "ratio needs whole tensors: use --eps-mode replicate with LAMB")
        if b.nodes > 1 and not (is_loopback_host(b.master_addr) or self.insecure):
            raise ValueError(f"--master-addr {b.master_addr} (not loopback): the boxes' gloo "
                             "group has no authentication, anyone who reaches its ports could "
                             "join or feed it; on a private network between the boxes give "
                             "--insecure to allow it")

    @property
    def model_record(self) -> dict | None:
        try:
            return json.loads(self.model_options) if self.model_options else None
        except ValueError:
            return None

    @property
    def compute_dtype(self) -> str:
        return PRECISIONS[self.precision]

    @property
    def loss_scaling(self) -> bool:
        """Dynamic loss scaling is on for fp16 compute (bf16 has fp32's range)."""
        return self.precision == "fp16"

    @property
    def math_threads(self) -> int:
        """``threads``, with 0 resolved to the cores this process may use."""
        return self.threads or available_cores()


def available_cores() -> int:
    """The cores this process may run on: its affinity mask (a container's cpuset, ``taskset``;
    os.cpu_count() counts the machine's), within its cgroup's CPU quota (``docker --cpus``)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    return min(cores, cgroup_cpu_quota() or cores)


def cgroup_cpu_quota(path: str = "/sys/fs/cgroup/cpu.max") -> int | None:
    """CPUs a cgroup v2 quota allows ("QUOTA PERIOD", rounded up), or None without one."""
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):  # no such file, or "max": no quota
        return None


@dataclass(kw_only=True)
class ServerArgs:
    """Everything eps-server takes (the root of its command line and config file)."""

    server: ServerConfig = field(default_factory=ServerConfig)


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
