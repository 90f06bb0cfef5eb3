"""A worker as ``StatusReply.workers`` shows it, and the report it sends with its heartbeats
(SPEC.md): its own module, as ``box_info`` is, for messages.py's size."""

from __future__ import annotations

from dataclasses import dataclass


def _require(ok: bool, field: str, what: str) -> None:
    if not ok:
        from .messages import FieldError  # (messages.py imports this module)

        raise FieldError(field, what)


@dataclass(frozen=True, kw_only=True)
class WorkerInfo:
    """A registered worker, as StatusReply shows it."""

    rank: int
    pid: int
    host: str
    step: int  # the step it is in (the first the EPS lacks some of its gradients for)
    silent: float  # seconds since it was last heard from
    report: WorkerReport | None = None  # its latest, from its heartbeats


@dataclass(frozen=True, kw_only=True)
class WorkerReport:
    """How a worker is doing, as of its last finished step (sent with its heartbeats; the EPS
    shows it in StatusReply and its metrics). Times in seconds, memory in bytes."""

    steps: int  # steps this worker finished (its last one is steps - 1)
    loss: float  # its micro-batches' mean loss in its last step
    step_seconds: float  # wall time of its last step
    fetch_wait: float  # ... of it spent waiting for weights
    push_wait: float  # ... of it spent waiting for gradient slots / push acks
    samples_per_sec: float  # over its steps so far
    memory: int  # device memory in use now (CPU: private RSS)
    peak_memory: int  # the most it has used

    def __post_init__(self) -> None:
        _require(self.steps >= 0, "steps", "must be >= 0")
        for name in ("step_seconds", "fetch_wait", "push_wait", "samples_per_sec"):
            _require(0.0 <= getattr(self, name) < 1e12, name, "must be in [0, 1e12)")
        _require(0 <= self.memory < 1 << 62 and 0 <= self.peak_memory < 1 << 62, "memory",
                 "out of range")
