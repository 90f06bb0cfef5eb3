"""The launcher's rows of steps and evaluations from its workers' reports (launch/reports.py):
a step a dead worker trained but never reported still gets its row; a part sent twice counts
once. (The end-to-end cases: a second worker killed while the first is replaced, a worker
killed while it evaluates; tests/test_recovery.py.)"""

from __future__ import annotations

import pytest

from launch.reports import Reports
from protocol.events import EvalDone, Joined, StepDone


def done(rank: int, step: int, loss: float = 0.25) -> StepDone:
    return StepDone(rank=rank, step=step, loss=loss, correct=3, count=4, samples=4,
                    seconds=0.1)


def joined(rank: int, step: int, rejoined: bool) -> Joined:
    return Joined(rank=rank, pid=1, step=step, pushed=0, rejoined=rejoined)


def test_a_step_trained_by_a_worker_that_died_before_reporting_it_keeps_its_row():
    """Before: the row of step 1 waited for rank 0's report forever, and the summary said the
    job trained 3 of its 4 steps."""
    r = Reports(2)
    assert r.joined(joined(0, 0, False)) == [] and r.joined(joined(1, 0, False)) == []
    assert [row["step"] for e in (done(0, 0), done(1, 0)) for row in r.step(e)] == [0]
    assert r.step(done(1, 1, loss=0.5)) == []  # rank 0 pushed all of step 1, then died
    rows = r.joined(joined(0, 2, True))  # its replacement resumes at step 2
    assert [(row["step"], row["unreported_ranks"]) for row in rows] == [(1, [0])]
    assert rows[0]["loss"] == pytest.approx(1.0)  # rank 1's share, for both
    assert r.completed() == 2
    assert [row["step"] for e in (done(0, 2), done(1, 2)) for row in r.step(e)] == [2]
    assert "unreported_ranks" not in r.rows[-1] and r.completed() == 3


def test_a_replacement_that_reports_what_it_redid_adds_no_row():
    """A replacement that resumes inside a step redoes and reports it: one row, all ranks."""
    r = Reports(2)
    for rank in (0, 1):
        r.joined(joined(rank, 0, False))
    r.step(done(1, 0))
    assert r.joined(joined(0, 0, True)) == []  # it redoes step 0: nothing unreported
    assert [row["step"] for row in r.step(done(0, 0))] == [0]
    assert "unreported_ranks" not in r.rows[0]
    assert r.step(done(0, 0)) == [] and len(r.rows) == 1  # reported again: counted once


def test_an_evaluation_part_sent_twice_counts_once():
    r = Reports(2)
    part = EvalDone(rank=0, step=2, loss_sum=8.0, correct=1, count=4, objective="lm")
    assert r.evaluation(part) is None
    assert r.evaluation(part) is None  # the replacement's redo, before the others' part
    result = r.evaluation(EvalDone(rank=1, step=2, loss_sum=4.0, correct=1, count=4,
                                   objective="lm"))
    assert result["loss"] == pytest.approx(1.5) and result["count"] == 8
    assert r.evaluation(part) is None and r.evals == [result]  # and after it


def test_a_restarted_job_reports_its_replayed_steps_again():
    r = Reports(1)
    r.joined(joined(0, 0, False))
    for s in range(4):
        r.step(done(0, s))
    assert r.replay_from(2) == 2 and [row["step"] for row in r.rows] == [0, 1]
    r.joined(joined(0, 2, False))  # the job restarted from its checkpoint of step 2
    assert [row["step"] for row in r.step(done(0, 2))] == [2]
