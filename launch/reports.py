"""The job's steps and evaluations from its workers' reports (StepDone, EvalDone events): a
step's row once every rank has reported it, an evaluation once every rank's part is in.

A worker killed after pushing all of a step but before reporting it never reports it: its
replacement resumes at the next step (its Joined says which). Such a step was trained, so its
row comes from the ranks that reported it (``unreported_ranks`` names the others; its loss
scaled up from their shares), rather than being left out of the summary. A part reported twice
(a replacement redoing an evaluation the dead worker may have sent) counts once."""

from __future__ import annotations

import threading

from protocol import events

from .results import eval_result, step_row


class Reports:
    def __init__(self, world: int, boxes: int = 1):
        self.world, self.boxes = world, boxes
        self.steps: dict[int, dict[int, events.StepDone]] = {}  # step -> rank -> event
        self.rows: list[dict] = []
        self.eval_parts: dict[int, dict[int, events.EvalDone]] = {}  # step -> rank -> part
        self.evals: list[dict] = []
        self._unreported: dict[int, set[int]] = {}  # step -> ranks whose report never comes
        self._next: dict[int, int] = {}  # rank -> the next step it reports
        self._rowed: set[int] = set()  # steps with a row
        self._lock = threading.Lock()

    def step(self, ev: events.StepDone) -> list[dict]:
        """The rows this report completes."""
        with self._lock:
            self._next[ev.rank] = max(self._next.get(ev.rank, 0), ev.step + 1)
            if self._complete(ev.step):
                return []  # reported already (a rank that redid the step counts once)
            self.steps.setdefault(ev.step, {})[ev.rank] = ev
            return self._rows([ev.step])

    def joined(self, ev: events.Joined) -> list[dict]:
        """A worker joined at step ``ev.step``; a replacement's predecessor trained the steps
        before it that it did not report: the rows this completes."""
        with self._lock:
            start, self._next[ev.rank] = self._next.get(ev.rank, ev.step), ev.step
            if not ev.rejoined:
                return []
            lost = range(start, ev.step)
            for s in lost:
                self._unreported.setdefault(s, set()).add(ev.rank)
            return self._rows(lost)

    def evaluation(self, ev: events.EvalDone) -> dict | None:
        """The evaluation this part completes, if it does."""
        with self._lock:
            parts = self.eval_parts.setdefault(ev.step, {})
            if len(parts) == self.world:
                return None  # complete already: a part sent again
            parts[ev.rank] = ev
            if len(parts) != self.world:
                return None
            result = eval_result(ev.step, list(parts.values())) | {"objective": ev.objective}
            self.evals.append(result)
            return result

    def completed(self) -> int:
        """Steps every worker has reported (or been seen to have trained)."""
        with self._lock:
            return max((s + 1 for s in self.steps if self._complete(s)), default=0)

    def replay_from(self, start: int) -> int:
        """Steps from ``start`` on are trained (and reported) again: their rows go."""
        with self._lock:
            self.steps = {s: e for s, e in self.steps.items() if s < start}
            self.rows = [p for p in self.rows if p["step"] < start]
            self._rowed = {p["step"] for p in self.rows}
            self.eval_parts = {s: e for s, e in self.eval_parts.items() if s <= start}
            self.evals = [e for e in self.evals if e["step"] <= start]
            self._unreported = {s: r for s, r in self._unreported.items() if s < start}
            self._next = {}
        return start

    def _complete(self, step: int) -> bool:
        by_rank = self.steps.get(step, {})  # (a row needs one report at least)
        return (bool(by_rank) or not self.world) and \
            len(by_rank.keys() | self._unreported.get(step, set())) == self.world

    def _rows(self, steps) -> list[dict]:
        """Rows for those of ``steps`` just completed (each once)."""
        made = []
        for s in steps:
            if s in self._rowed or not self._complete(s):
                continue
            self._rowed.add(s)
            parts = list(self.steps[s].values())
            row = step_row(s, parts, self.boxes)
            if len(parts) < self.world:  # the others' shares as the reported ones' mean
                row["loss"] *= self.world / len(parts)
                row["unreported_ranks"] = sorted(set(range(self.world)) - self.steps[s].keys())
            self.rows.append(row)
            made.append(row)
        return made
