"""Forward graphs kept for the backward under an activation budget (--activation-budget-gib).

L2L recomputes each block's forward in the backward: 4/3 of the work. A kept block instead
runs its forward with grad and holds its graph (every saved activation of its u micro-batches,
its output, and a private copy of its weights) until its backward, which then skips the
recompute. The blocks worth keeping are the last ones of the forward: their backward comes
first, so their graphs are held the shortest, and a kept suffix needs no stash entries. The
last block is always kept (its weights stay held, as they are in use until its backward right
after the head's; it costs one layer's activations, the constant need of the loop).

Why whole graphs and not only the matmul outputs of more blocks (selective checkpointing):
`python -m bench keep` measures one block on the CPU (BERT/GPT H=256, T=128, B=8): its whole
graph is 23 MiB and spares 45-51 ms of recompute, its matmul outputs 12 MiB and 25 ms: about
the same seconds per GiB (2.0-2.3 vs 2.1), and a budget holding every block's whole graph
spares all the recompute, which no selective policy does. Whole graphs also need no second
recompute path whose results must again equal plain training's. On a GPU, where matmuls are
a larger share of the forward's time, keeping matmul outputs could spare more per byte when
the budget holds only some of the blocks: not built.

The budget's size: G GiB given, or -1 (auto): on CUDA the device memory free at start, shared
equally by the job's ranks on the device (or the --device-memory-gib cap), less what the first
step peaked at (the constant need) and a safety margin; on the CPU 0. The first step keeps
only the last block and measures its graph's bytes (saved-tensor hooks, each storage once);
from the second step on the worker keeps as many more blocks as fit. Kept blocks use the same
dropout seeds as the recompute, so the results are the recomputing loop's.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch

from .stash import members

log = logging.getLogger("l2l_worker")

MARGIN_FRACTION = 0.05  # auto: of the memory available at start, left for fragmentation
MARGIN_BYTES = 1 << 30  # ... plus this


@dataclass
class Kept:
    """A layer's forward graph kept for its backward (per micro-batch)."""

    leaves: dict[str, torch.Tensor]
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    cloned: bool = False  # the leaves are private copies (the layer's source buffer is free)


class SavedBytes:
    """Counts the bytes autograd saves for backward within the context (and any tensor
    ``add``ed), each storage once; ``total`` leaves out those counted elsewhere (weights)."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def add(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        self.storages.setdefault(s.data_ptr(), s.nbytes())

    @contextlib.contextmanager
    def hooks(self):
        def pack(t):
            self.add(t)
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield self

    def total(self, exclude=()) -> int:
        skip = {t.untyped_storage().data_ptr() for t in exclude}
        return sum(n for ptr, n in self.storages.items() if ptr not in skip)


def graph_bytes(kept: Kept, saved: SavedBytes, private: list[torch.Tensor]) -> int:
    """Device bytes a kept block holds: its saved activations, inputs (the lowest kept
    block's stay on the device instead of in the stash; for the others this counts a
    boundary twice, erring on the safe side) and outputs, and the weights a kept copy holds
    (``private``: not tied tensors, which are held once for every reader)."""
    for x in (*kept.inputs, *kept.outputs):
        for t in members(x):
            saved.add(t)
    return saved.total(exclude=list(kept.leaves.values())) + sum(
        t.numel() * t.element_size() for t in private)


class GraphBudget:
    """How many blocks, beyond the last, a step keeps the graphs of."""

    def __init__(self, gib: float, device: torch.device, cap_gib: float = 0.0,
                 sharing: int = 1):
        """``gib``: --activation-budget-gib (-1: auto); ``cap_gib``: --device-memory-gib;
        ``sharing``: ranks of the job on this device (auto gives each an equal part)."""
        self.device = device
        self.auto = gib < 0
        self.bytes = 0 if self.auto else int(gib * 2**30)
        self.available = 0  # auto on CUDA: the device memory this worker may use at all
        if self.auto and device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            free //= max(1, sharing)
            self.available = min(free, int(cap_gib * 2**30)) if cap_gib else free
        self.per_block = 0  # measured: bytes one more kept block holds
        self.blocks = 0  # kept beside the last block, from the step after the measurement
        self.most = 0  # the most blocks a step kept (the last one included)
        self.measured: int | None = None  # bytes the last block's graph held, this step
        self.decided = False

    def measuring(self) -> bool:
        return not self.decided

    def step_done(self) -> None:
        """A step ended: if it measured a block's graph, decide (with its device peak)."""
        if self.measured is not None and not self.decided:
            cuda = self.device.type == "cuda"
            self.decide(self.measured, torch.cuda.max_memory_allocated(self.device) if cuda
                        else 0)

    def decide(self, per_block: int, constant: int) -> None:
        """After the first step: ``per_block`` bytes a kept block holds (with its weights),
        ``constant`` the step's device peak (CUDA) without any kept block but the last."""
        self.decided = True
        self.per_block = max(per_block, 1)
        if self.auto:
            margin = int(self.available * MARGIN_FRACTION) + MARGIN_BYTES
            self.bytes = max(0, self.available - constant - margin) if self.available else 0
        self.blocks = self.bytes // self.per_block
        if self.bytes:
            log.info("activation budget %.2f GiB: %d more blocks keep their graphs "
                     "(%.1f MiB each)", self.bytes / 2**30, self.blocks, per_block / 2**20)

    def kept(self, visits: list[int]) -> tuple[int, list[int]]:
        """(the held block, the blocks kept with copies of their weights) of a step visiting
        ``visits`` (pre, blocks, post): the last block, and up to ``blocks`` before it (never
        the first layer, whose recompute is an embedding lookup and whose weights are large)."""
        if len(visits) < 3:
            return -1, []
        blocks = visits[1:-2]
        return visits[-2], blocks[max(0, len(blocks) - self.blocks):]
