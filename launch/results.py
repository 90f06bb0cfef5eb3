"""How the launcher puts the workers' parts together: a step's row (the console line and the
summary's per-step lists) and an evaluation."""

from __future__ import annotations

import math

from protocol import events
from protocol.checkpoints import latest


def step_row(step: int, parts: list[events.StepDone], boxes: int = 1) -> dict:
    """Every rank's report of ``step``: the loss is the sum of their shares of the global mean
    (with several boxes, this box's workers' mean: their shares times the boxes), the time and
    waits its slowest worker's."""
    slowest = max(parts, key=lambda r: r.seconds)
    return {"step": step, "loss": boxes * sum(r.loss for r in parts),
            "accuracy": sum(r.correct for r in parts) / max(1, sum(r.count for r in parts)),
            "seconds": slowest.seconds, "samples": sum(r.samples for r in parts),
            "fetch_wait": slowest.fetch_wait, "push_wait": slowest.push_wait,
            "compute": slowest.seconds - slowest.fetch_wait - slowest.push_wait}


def eval_result(step: int, parts: list[events.EvalDone]) -> dict:
    """One evaluation from the workers' shares: mean loss per term, accuracy, perplexity."""
    count = max(1, sum(p.count for p in parts))
    loss = sum(p.loss_sum for p in parts) / count
    return {"step": step, "loss": loss, "accuracy": sum(p.correct for p in parts) / count,
            "perplexity": math.exp(min(loss, 50.0)), "count": count}


def eval_line(result: dict) -> str:
    """The console's line for an evaluation (eval_result with its objective)."""
    metric = (f"accuracy {result['accuracy']:.3f}" if result["objective"] == "classify"
              else f"perplexity {result['perplexity']:.3f}")
    return f"eval after {result['step']:>5} steps  loss {result['loss']:.4f}  {metric}"


def resume_hint(root: str) -> str:
    """The end of a failed job's last line: the latest checkpoint under its --server-save
    ``root``, to go on from with --load; "" if there is none."""
    found = latest(root) if root else None
    return (f"; its latest checkpoint is step {found[1]}: go on from there with --load {root}"
            if found else "")


def checkpoint_failure(ev, policy: str) -> str:
    """The console line of a checkpoint the EPS could not write (an events.CheckpointFailed),
    under --checkpoint-errors ``policy``."""
    last = (f"the latest good checkpoint is step {ev.last_step}" if ev.last_step >= 0
            else "there is no good checkpoint yet")
    then = ("stopping the job (--checkpoint-errors fail)" if policy == "fail" else
            "training is complete" if ev.final else
            "training goes on, the next one will be tried")
    return (f"l2l-launch: {'final ' if ev.final else ''}checkpoint of step {ev.step} to "
            f"{ev.path} failed: {ev.error}; {last}; {then}")
