"""Configuration of l2l-launch: its own options, plus the model, data, worker and server options
it passes on (the same fields as l2l-worker's and eps-server's, minus those it sets per child)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from eps_server.config import ServerConfig
from protocol.shm import is_run_id
from worker.config import DataConfig, ModelConfig, WorkerConfig, check_save

# Set by the launcher for each child, so not options of its own.
PER_WORKER = ("endpoint", "rank", "world_size", "box", "boxes", "save", "summary_json", "trace",
              "events", "log_level")
PER_SERVER = ("endpoint", "world_size", "run_id", "exit_when_done", "trace", "events",
              "log_level", "model_options", "job_options")


@dataclass(kw_only=True)
class LaunchConfig:
    """The job on this box: one eps-server and ``workers`` l2l-workers."""

    workers: int = 1
    """Worker processes (one per device; with --device cuda, rank r runs on cuda:(r mod GPUs))."""
    role: Literal["all", "eps", "worker"] = "all"
    """all: the EPS and --workers workers on this box. eps or worker: only that part of the
    job, in the foreground, logging to stderr (one container each, see deploy/); a worker
    takes the lowest free rank (--rank), an EPS resumes from the newest checkpoint under
    --server-save if there is one (a restarted container continues the job)."""
    rank: int = -1
    """With --role worker: this worker's rank; -1: the EPS assigns the lowest free one."""
    run_id: str = ""
    """The run's name: its directory under --runs-dir and its shared memory's prefix;
    empty: a random one. Give the same one to every --role of a job."""
    plan: bool = False
    """Print the model's layers and tensors (the names --freeze matches) and what the job
    needs (the EPS's shared memory: a container's shm_size), and exit."""
    endpoint: str = ""
    """The EPS's endpoint; empty: a private ipc socket in a folder of its own (--role all;
    kept in runs/<run id>/endpoint while the job runs, where l2l-ctl finds it), else
    eps-server's default (ipc, per user)."""
    summary_json: str = ""
    """Write the run summary (losses, accuracy, throughput, peak memory, EPS stats) here;
    --role worker: each worker's own summary, {rank} in the name or -<rank> added."""
    save: str = ""
    """Write the trained model here: a built-in model or your own as one safetensors file (the
    assembled nn.Module's names), an hf: model as a save_pretrained directory (config.json,
    model.safetensors, tokenizer files) that from_pretrained loads."""
    trace: str = ""
    """Write one Chrome/Perfetto trace of all processes here (render it with
    python -m bench.timeline TRACE --png OUT)."""
    runs_dir: str = "runs"
    """Each job gets a directory here, runs/<run id>: the children's logs (eps.log, w0.log, ...),
    the resolved job config (config.json), the summary (summary.json) and, while it runs, its
    EPS's endpoint (endpoint: l2l-ctl status finds the job by it); with --role, the config,
    each worker's summary (worker-<rank>.json) and the EPS's endpoint."""
    verbose: bool = False
    """Show every line the children log (by default only their warnings and errors reach the
    console; all of it is in the run directory)."""
    quiet: bool = False
    """Show none of the children's log lines (progress and failures are still shown)."""
    log_every: int = 10
    """When stdout is not a terminal (CI, a pipe): print a progress line every N steps (and
    the first and last); on a terminal a live progress bar is shown instead."""
    max_restarts: int = 0
    """Restarts allowed in all: a worker that dies or hangs is started again and redoes its
    step exactly (this turns on the EPS's --recovery); a dead EPS restarts the job from its
    last checkpoint (--server-save, --checkpoint-every). 0: any failure fails the job."""

    checkpoint_errors: Literal["warn", "fail"] = "warn"
    """A checkpoint the EPS cannot write (a full or read-only disk) is said at once, also with
    --quiet, and counted (summary, l2l-ctl status, metrics); the previous one stays the latest
    and the next is tried again. warn: the job goes on and exits 0 if training and --save
    completed (the summary's checkpoint_failures says what failed); fail: the first failure
    stops the job, exit status 1, so that a scheduler can move it."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError("--workers must be >= 1")
        if self.max_restarts < 0:
            raise ValueError("--max-restarts must be >= 0")
        if self.log_every < 1:
            raise ValueError("--log-every must be >= 1")
        if not -1 <= self.rank < self.workers:
            raise ValueError("--rank must be in [0, --workers), or -1 (any free rank)")
        if self.run_id and not is_run_id(self.run_id):
            raise ValueError("--run-id must be 1..64 letters, digits or underscores")


@dataclass(kw_only=True)
class LaunchArgs:
    """Everything l2l-launch takes (the root of its command line and config file)."""

    launch: LaunchConfig = field(default_factory=LaunchConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig, metadata={"omit": PER_WORKER})
    server: ServerConfig = field(default_factory=ServerConfig, metadata={"omit": PER_SERVER})

    def __post_init__(self) -> None:
        check_save(self.model, self.launch.save)
