"""The engines' typed jobs and their results (engines.py runs them; the core and the
scheduler make them and read what comes back)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .config import OptimizerConfig
from .layer_math import Checked
from .speculation import StepNorms

# ----------------------------------------------------------------------------- tickets


@dataclass(frozen=True)
class PushTicket:
    """Whom to answer about one pushed gradient."""

    peer: bytes
    req_id: int
    rank: int
    step: int
    layer: int
    slot: int
    framed: bool  # came as a tensor frame (else: read from the rank's shared slot)


@dataclass(frozen=True)
class Part:
    """One rank's pushed gradient of a layer, read where it lies until its job is done."""

    src: torch.Tensor
    ticket: PushTicket

    @property
    def nbytes(self) -> int:
        return self.src.numel() * self.src.element_size()


@dataclass(frozen=True)
class Requester:
    """Whom to answer about a request that an engine job completes (InitLayer, Save)."""

    peer: bytes
    req_id: int


# ----------------------------------------------------------------------------- jobs


class Action(enum.Enum):
    FINAL = "final"  # update now; the new version is published when done
    SPECULATE = "speculate"  # if the guess says so (speculation.py) update now, keep the
    #                          gradient, publish once the step is decided; else as HOLD
    HOLD = "hold"  # keep the gradient; updated once the step is decided


class Verdict(enum.Enum):
    APPLY = "apply"  # a held gradient: update with the step's divisor
    REDO = "redo"  # a speculative update: undo it, update with the step's divisor
    UNDO = "undo"  # a speculative update: undo it (the step is skipped)


@dataclass(frozen=True)
class Init:
    """Write a layer's initial values (refused if not all finite, or if fp16 compute cannot
    hold them): fp32, whole, or ``tail`` its frozen tensors in the compute dtype after
    ``data``, its trainable prefix. Result: why they are refused ("" if not)."""

    layer: int
    data: torch.Tensor
    requester: Requester
    tail: torch.Tensor | None = None


@dataclass(frozen=True)
class Update:
    """Every rank's gradient of ``layer`` for step ``t`` is in: check it, then ``action``
    unless an element is not finite (then nothing is written). Result: ``Updated``."""

    layer: int
    t: int
    parts: tuple[Part, ...]  # rank order
    action: Action
    grad_scale: float  # the loss scale (a speculative update assumes no clipping)
    cfg: OptimizerConfig
    norms: StepNorms | None = None  # SPECULATE: the step's norms, for the guess
    skips_overflow: bool = False  # fp16 loss scaling: a non-finite sum skips the step


@dataclass(frozen=True)
class Updated:
    checked: Checked
    rewritten: bool  # the layer's weights changed
    kept: torch.Tensor | None  # the kept gradient (SPECULATE, HOLD)
    check_seconds: float


@dataclass(frozen=True)
class Resolve:
    """The step's decision for a layer whose gradient was kept; the buffer is given back.
    Result: None."""

    layer: int
    t: int
    verdict: Verdict
    kept: torch.Tensor
    grad_scale: float  # APPLY, REDO: the step's divisor (loss scale / clipping coefficient)
    spec_scale: float  # REDO, UNDO: the divisor the speculative update used
    cfg: OptimizerConfig


@dataclass(frozen=True)
class SaveTicket:
    requester: Requester | None  # None: a periodic checkpoint
    path: str
    target: int  # the step written
    extra: dict


@dataclass(frozen=True)
class Exclusive:
    """Run ``fn()`` while no other engine runs anything (checkpoints). Result: its return."""

    fn: Callable[[], Any]
    what: str
    ticket: SaveTicket


@dataclass
class Done:
    job: Any
    result: Any = None
    error: BaseException | None = None
    seconds: float = 0.0
