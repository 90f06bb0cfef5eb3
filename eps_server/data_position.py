"""Where the job stands in its data, so that a run resumed with another batch shape (another
number of workers, micro-batches or micro-batch size) goes on from the samples its checkpoint's
run consumed, instead of counting ``step * samples a step`` anew (which would train records
again, or skip them, within the epoch).

Each worker says in its Hello how many samples a step takes (every worker's micro-batches of
every box); the EPS answers with the origin ``(step, samples)``: the samples consumed by the
steps before ``step``. A worker's sample positions of step ``s`` start at ``samples + (s -
step) * per step``. A checkpoint records the samples consumed before its own step and the
samples a step took; a run resumed from it takes that step as its origin. A fresh run's
origin is (0, 0); a checkpoint that records none (of an older version) counts ``step * samples
a step`` as before.
"""

from __future__ import annotations

from .errors import RequestError


class DataPosition:
    def __init__(self) -> None:
        self.step = 0  # the origin's step
        self.samples: int | None = 0  # samples consumed before it (None: not recorded)
        self.per_step = 0  # samples a step takes in this run (0: no worker has said yet)
        self.loaded_per_step = 0  # ... in the run of the checkpoint resumed from

    def loaded(self, step: int, state: dict) -> None:
        """Resumed at ``step`` from a checkpoint whose state.json is ``state``."""
        data = state.get("data")
        self.step, self.samples = step, None
        if isinstance(data, dict) and isinstance(data.get("samples"), int) and isinstance(
                data.get("per_step"), int) and data["samples"] >= 0 and data["per_step"] >= 0:
            self.samples, self.loaded_per_step = data["samples"], data["per_step"]

    def check(self, per_step: int) -> None:
        """Refuse a worker whose steps take another number of samples than the job's."""
        if per_step and self.per_step and per_step != self.per_step:
            raise RequestError("bad_request", f"this worker's steps take {per_step} samples, "
                               f"the job's take {self.per_step} (every worker's micro-batches "
                               "of every box): the workers' --micro-batches and "
                               "--micro-batch-size must agree", "samples_per_step")

    def joined(self, per_step: int) -> tuple[int, int]:
        """A worker whose steps take ``per_step`` samples (0: it does not say) has joined (as
        ``check`` allowed): the origin it counts its data positions from."""
        self.check(per_step)
        self.per_step = self.per_step or per_step
        return self.step, self.consumed(self.step)

    def consumed(self, step: int) -> int:
        """Samples the steps before ``step`` consumed (``step`` >= the origin's)."""
        samples = self.samples if self.samples is not None else self.step * self.per_step
        return samples + (step - self.step) * self.per_step

    def record(self, step: int) -> dict | None:
        """What a checkpoint of ``step`` says of the data (None where nothing is known)."""
        per_step = self.per_step or self.loaded_per_step
        if self.samples is None and not self.per_step:
            return None
        return {"samples": self.consumed(step), "per_step": per_step}
