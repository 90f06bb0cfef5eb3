"""Each layer's contributions to the current step (the core's bookkeeping; no math): which
ranks have pushed (or, with LayerDrop, skipped) it, and how many skips are counted.

A rank *claims* its part when its push is accepted and releases it if the gradient is then
refused (non-finite), so it may push again. Once every rank has claimed a layer nobody may read
its current version any more; once every part is in, the layer is due for its update (or, if
every rank skipped it, for a version advance without one).

A skip may come one step early: a worker skips a layer without fetching it, so it cannot know
whether the layer has reached the step's version yet. Such a skip waits here until it has.
"""

from __future__ import annotations

from .errors import RequestError


class Contributions:
    def __init__(self, num_layers: int, world_size: int):
        self.world_size = world_size
        self._claims: list[set[int]] = [set() for _ in range(num_layers)]
        self._skips: list[set[int]] = [set() for _ in range(num_layers)]
        self._done = [0] * num_layers  # skips counted
        self._early: list[set[int]] = [set() for _ in range(num_layers)]  # next step's skips

    def skip_early(self, layer: int, rank: int, first: bool = False) -> None:
        """``rank`` skips ``layer`` in the step after the current one, which it must have
        done its part of already (``first``: the layer has no version yet, and this is a
        skip of step 0, which may come before the initial values)."""
        if rank not in self._claims[layer] and not first:
            raise RequestError("bad_request", f"rank {rank} skips layer {layer} for the next "
                               "step before pushing it for this one", "step")
        if rank in self._early[layer]:
            raise RequestError("bad_request", f"rank {rank} already skipped layer {layer} for "
                               "the next step", "rank")
        self._early[layer].add(rank)

    def claim(self, layer: int, rank: int, skip: bool = False) -> None:
        """Register ``rank``'s push of ``layer``; a duplicate, or a skip where others pushed a
        gradient (or the reverse), is refused and changes nothing."""
        if rank in self._claims[layer]:
            raise RequestError("bad_request", f"rank {rank} already pushed layer {layer} for "
                               "this step", "rank")
        if self._claims[layer] and bool(self._skips[layer]) != skip:
            raise RequestError("bad_request", f"ranks disagree on skipping layer {layer}",
                               "skip")
        self._claims[layer].add(rank)
        if skip:
            self._skips[layer].add(rank)

    def release(self, layer: int, rank: int) -> None:
        """Undo a claim whose gradient was refused before it was added."""
        self._claims[layer].discard(rank)

    def has(self, layer: int, rank: int) -> bool:
        """``rank``'s part of ``layer`` for the current step is in (held, or read)."""
        return rank in self._claims[layer]

    def skips_early(self, layer: int, rank: int) -> bool:
        return rank in self._early[layer]

    def all_claimed(self, layer: int) -> bool:
        return len(self._claims[layer]) == self.world_size

    def add(self, layer: int) -> bool:
        """One more part is in; True when it was the last."""
        self._done[layer] += 1
        return self._done[layer] == self.world_size

    def reset(self, layer: int) -> bool:
        """The layer's next version is published: ready for the next step, whose early skips
        count now; True if they are every rank's (the new step is skipped as a whole)."""
        self._claims[layer].clear()
        self._skips[layer].clear()
        self._done[layer] = 0
        early, self._early[layer] = self._early[layer], set()
        for rank in early:
            self.claim(layer, rank, skip=True)
            self._done[layer] += 1
        return bool(early) and self._done[layer] == self.world_size
