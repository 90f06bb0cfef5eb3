"""What becomes of a checkpoint once written or failed: one log line (no traceback for what
the OS refused: a full or read-only disk is an operating condition, not a bug), the counters
that Status and the metrics show, and an event for whoever started the EPS (l2l-launch says
the first failure on its console at once, also with --quiet). A failed checkpoint leaves no
partial files (checkpoint.py), the previous one stays the latest, and the next is tried."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from protocol.checkpoints import latest
from protocol.events import CheckpointFailed
from protocol.messages import Ack

from .boxes import BoxLost
from .replies import Out, error_out
from .stats import EpsStats

if TYPE_CHECKING:
    from .scheduler import Saved

log = logging.getLogger("eps_server")


def describe(e: BaseException) -> str:
    """One line: an OSError as the OS says it ("No space left on device [ENOSPC]"), anything
    else with its type (a bug: its traceback is logged where it happened)."""
    if isinstance(e, OSError) and e.strerror:
        name = errno.errorcode.get(e.errno or 0, "")
        return f"{e.strerror}{f' [{name}]' if name else ''}"
    return f"{type(e).__name__}: {e}"


class SaveOutcomes:
    def __init__(self, stats: EpsStats, notify: Callable[[object], None]):
        self.stats, self.notify = stats, notify
        self._failing = 0  # failures since the last checkpoint written
        self.last: tuple[str, int] | None = None  # (where, step) of the last written or loaded

    def resume_hint(self, what: str = "it") -> str:
        """What a failure message says to do next: ``--load`` the last checkpoint, if any."""
        if self.last is None:
            return f"there is no checkpoint to restart {what} from (--server-save)"
        return f"restart {what} with --load {self.last[0]} (its checkpoint of step {self.last[1]})"

    def written(self, step: int, path: str, final: bool = False) -> None:
        self.stats.checkpoints_written += 1
        self.stats.last_checkpoint_step = step
        self.last = (path, step)
        what = "final checkpoint" if final else "checkpoint"
        if self._failing:
            log.warning("%s of step %d written to %s, after %d that failed", what, step, path,
                        self._failing)
        else:
            log.info("%s of step %d written to %s", what, step, path)
        self._failing = 0

    def failed(self, step: int, path: str, error: str, final: bool = False,
               requested: bool = False) -> None:
        """Logged and counted; the launcher is told of the job's own checkpoints only (a
        requested one, l2l-ctl save's, was answered with the error: it does not fail the job
        under --checkpoint-errors fail, nor is it a checkpoint the job lacks)."""
        self.stats.checkpoint_failures += 1
        self._failing += 1
        found = latest(path)
        last = found[1] if found else -1
        log.error("%s of step %d to %s failed: %s; %s", "final checkpoint" if final else
                  "checkpoint", step, path, error,
                  f"the latest good one there is step {last} ({found[0]})" if found else
                  "there is no good one there yet")
        if not requested:
            self.notify(CheckpointFailed(step=step, path=path, error=error, last_step=last,
                                         final=final))

    def cut_off(self, step: int, path: str, error: str) -> None:
        """A box was lost while the boxes wrote a periodic checkpoint: not a failure of the
        disk (nor counted as one, which --checkpoint-errors fail would stop the job for) but of
        the boxes' group, which stops this EPS (BOX_LOST) for a restart from the last complete
        checkpoint. (The final checkpoint's, at exit, is a failure: nothing restarts then.)"""
        found = latest(path)
        log.warning("checkpoint of step %d to %s cut off: %s; %s", step, path, error,
                    f"the latest complete one there is step {found[1]}" if found else
                    "there is no complete one there yet")

    def settle(self, saved: Saved) -> list[Out]:
        """A checkpoint's outcome: logged and counted; a Save's requester gets its Ack, or an
        Error: ``resource`` where the OS refused (say, a full disk), else ``internal``."""
        if saved.error is None:
            self.written(saved.step, saved.path)
        elif saved.lost:
            self.cut_off(saved.step, saved.path, saved.error)
        else:
            self.failed(saved.step, saved.path, saved.error, requested=saved.requester is not None)
        who = saved.requester
        if who is None:
            return []
        if saved.error is not None:
            return [error_out(who.peer, who.req_id, "resource" if saved.refused else "internal",
                              f"checkpoint of step {saved.step} to {saved.path} failed: "
                              f"{saved.error}")]
        return [Out(who.peer, Ack(req_id=who.req_id))]

    def final(self, write: Callable[[], bool | None], step: int, path: str) -> None:
        """The checkpoint written as the EPS exits (``write``: True if it wrote one): a
        refusal by the OS is said and counted like any other, and the EPS exits normally (its
        workers finished; the launcher's --checkpoint-errors decides what the job's exit
        status says)."""
        try:
            if write():
                self.written(step, path, final=True)
        except (OSError, BoxLost) as e:  # (shard mode: a box gone while they wrote it; at
            self.failed(step, path, describe(e), final=True)  # exit nothing restarts: a failure)
