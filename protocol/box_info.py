"""One box of a job over several (``--nodes``), as ``StatusReply.boxes`` shows it (SPEC.md
section 12): what that box's EPS last published of itself, and how fresh that is."""

from __future__ import annotations

from dataclasses import dataclass

# ok: published within the last few seconds; stale: not republished since (the box is hung,
# or stopped); missing: never published; unknown: the store could not be read (box 0, which
# hosts it, is gone or does not answer): the values are the last ones read, if any.
BOX_STATES = ("ok", "stale", "missing", "unknown")


@dataclass(frozen=True, kw_only=True)
class BoxInfo:
    box: int  # the box's rank (--node-rank)
    state: str  # one of BOX_STATES
    age: float = -1.0  # seconds since its summary last changed, as seen here (-1: never seen)
    host: str = ""
    step: int = 0  # steps completed by every layer of its EPS (StatusReply.step)
    newest: int = 0  # the highest layer version (step .. newest: the versions' range)
    steps_completed: int = 0  # steps its EPS completed since it started
    workers: int = 0  # its registered workers
    alive: int = 0  # ... of them heard from within half the heartbeat timeout
    world_size: int = 0  # its workers in all (--workers)
    last_checkpoint: int = -1  # the step of its last checkpoint (-1: none)
    lost: bool = False  # its cross-box group failed (its EPS is stopping)

    def __post_init__(self) -> None:
        from .messages import FieldError  # (messages.py imports this module)

        if self.state not in BOX_STATES:
            raise FieldError("state", f"must be one of {BOX_STATES}")
        if not 0 <= self.box < 1024:
            raise FieldError("box", "must be in [0, 1024)")
