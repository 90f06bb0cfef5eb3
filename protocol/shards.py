"""``--eps-mode shard``: which part of every layer a box owns (ZeRO-1 across the boxes).

Each layer's flat span (protocol.tensors) is cut into ``count`` equal chunks of
``chunk(numel)`` elements (the last ones shorter, or empty, where the span does not divide);
box r owns chunk r: its fp32 master and optimizer state hold those elements only, while the
copy served to its workers stays whole. A chunk is a multiple of ``ALIGN`` elements, so every
chunk starts on a cache line in every dtype. A step's gradient is reduce-scattered over the
padded span (``count`` x chunk), the owner updates its chunk, and the served copy is
all-gathered (boxes.py). Pure functions of the layout: every box, and every loader of a
checkpoint written with another number of boxes, computes the same cuts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from protocol.tensors import LayerPlan

ALIGN = 16  # elements: 64 bytes of fp32


@dataclass(frozen=True)
class Sharding:
    rank: int  # this box
    count: int  # boxes

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.count:
            raise ValueError(f"shard {self.rank} of {self.count}")

    def chunk(self, numel: int) -> int:
        per = -(-numel // self.count)
        return -(-per // ALIGN) * ALIGN

    def span(self, numel: int, rank: int | None = None) -> tuple[int, int]:
        """[lo, hi) of the layer's elements that box ``rank`` (this one) owns."""
        c = self.chunk(numel)
        r = self.rank if rank is None else rank
        lo = min(r * c, numel)
        return lo, min(lo + c, numel)

    def padded(self, numel: int) -> int:
        """Elements a reduce-scatter or all-gather of the layer moves: count x chunk."""
        return self.count * self.chunk(numel)


def serves_master(compute_dtype: str, sharding: Sharding | None) -> bool:
    """Whether the EPS's fp32 master is every layer whole (frozen tensors too), served as it
    is (fp32 compute, no shards), rather than the trained parts beside a served copy."""
    return compute_dtype == "float32" and sharding is None


def master_spans(layers, sharding: Sharding | None) -> list[tuple[int, int]]:
    """[lo, hi) of each layer that the EPS's master trains: its trainable prefix (frozen
    tensors are never updated) or, sharded, this box's span of it."""
    return [(0, p.trainable) if sharding is None else sharding.span(p.trainable)
            for p in layers]


def shard_plan(plan: LayerPlan, lo: int, hi: int, offset: int) -> LayerPlan:
    """The plan an optimizer of elements [lo, hi) of ``plan``'s layer sees: its groups cut to
    the range (relative to ``lo``), no whole tensors (an element-wise optimizer needs none),
    ``offset`` its first element in the master region of shards."""
    groups = {}
    for group, (start, end) in plan.groups.items():
        s, e = max(start, lo), min(end, hi)
        if s < e:
            groups[group] = (s - lo, e - lo)
    return replace(plan, offset=offset, numel=hi - lo, tensors=(), groups=groups, ties=())
