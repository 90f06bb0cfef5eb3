"""Fault injection for failure tests: ``--fault RANK:STEP:POINT[:stop]`` makes the worker of
rank RANK kill itself with SIGKILL (or stop itself with SIGSTOP, a hung process) when its loop
reaches POINT of step STEP; other ranks ignore it (l2l-launch passes one config to all).

POINT is a visit of the L2L loop, named as in traces: F<l> (forward visit of layer l), H<l>
(the head's forward and backward), B<l> (backward visit of layer l), P (every push of the step
acknowledged, the step not yet reported) or E (between steps: the step reported, an evaluation
due after it not yet run). A worker that rejoins (a
replacement: l2l-launch's, or a restarted container running the same command) ignores it.

``--cuda-delay POINT:US[,...]`` (``parse_delays``) slows a CUDA stream instead of the process:
streams.Streams.stall spins the GPU there, so a missing event wait shows in the results.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass

_SPEC = re.compile(r"^(\d+):(\d+):([FHB]\d+|[PE])(?::(kill|stop))?$")


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    point: str
    signal: int

    @classmethod
    def parse(cls, text: str, rank: int | None = None) -> Fault | None:
        """The fault ``text`` names for ``rank`` (None: check the syntax only)."""
        if not text:
            return None
        m = _SPEC.match(text)
        if m is None:
            raise ValueError(f"fault must be RANK:STEP:POINT[:kill|stop] with POINT F<l>, H<l>, "
                             f"B<l>, P or E, got {text!r}")
        fault = cls(int(m.group(1)), int(m.group(2)), m.group(3),
                    signal.SIGSTOP if m.group(4) == "stop" else signal.SIGKILL)
        return fault if rank is None or rank == fault.rank else None

    def at(self, step: int, point: str) -> None:
        if step == self.step and point == self.point:
            os.kill(os.getpid(), self.signal)


DELAY_POINTS = ("copy", "compute", "d2h", "copy-back")
CYCLES_PER_US = 2000  # torch.cuda._sleep spins for GPU clock cycles: ~1 us at 2 GHz


def parse_delays(text: str) -> dict[str, int]:
    """``--cuda-delay copy:US,compute:US,d2h:US,copy-back:US`` -> {point: GPU cycles to spin
    there}."""
    delays: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        point, _, us = item.partition(":")
        if point not in DELAY_POINTS or not us.isdigit():
            raise ValueError(f"cuda delay must be POINT:MICROSECONDS[,...] with POINT in "
                             f"{DELAY_POINTS}, got {item!r}")
        delays[point] = int(us) * CYCLES_PER_US
    return delays
