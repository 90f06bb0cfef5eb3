"""Layer versions and the Fetches waiting for them (the core's bookkeeping; no I/O, no threads).

``versions[l]`` counts the updates applied to layer l (-1 before its initial values arrive);
step t reads version t. A Fetch for (l, v) is answered once the layer has reached v and, when
the answer must carry step v's fp16 loss scale (``gate_on_step``), once every layer has (step
v-1 is complete, so the scale is decided). Versions are mirrored into the store's shared
version board, so shm workers see a published version without asking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .layer_store import LayerStore


@dataclass(frozen=True)
class Waiter:
    peer: bytes
    request: Any  # the Fetch
    layer: int
    version: int
    # Recovery: ``version`` is being replaced; answer (from the retained copy) once the layer
    # has moved past it, or once the job rewriting it has copied it (``retained``), never
    # while that copy is being made.
    retained: bool = False


class VersionBoard:
    def __init__(self, store: LayerStore, gate_on_step: bool, retained: set[int]):
        self.store = store
        self.versions = store.versions  # written through set() only
        self.gate_on_step = gate_on_step
        self.retained = retained  # layers whose retained copy holds their current version
        self._waiters: list[Waiter] = []

    @property
    def step(self) -> int:
        """Steps completed by every layer (the lowest version)."""
        return min(self.versions)

    def ready(self, layer: int, version: int) -> bool:
        return self.versions[layer] >= version and (not self.gate_on_step
                                                    or self.step >= version)

    def wait(self, waiter: Waiter) -> None:
        self._waiters.append(waiter)

    def set(self, layer: int, version: int) -> bool:
        """Record a layer's new version; True if that completed a step (raised the minimum)."""
        before = self.step
        self.store.set_version(layer, version)
        return self.step > before

    def answerable(self) -> list[Waiter]:
        """Remove and return the waiters whose version now exists."""
        ready = [w for w in self._waiters if self._due(w)]
        if ready:
            self._waiters = [w for w in self._waiters if not self._due(w)]
        return ready

    def _due(self, w: Waiter) -> bool:
        if w.retained:
            copied = self.versions[w.layer] > w.version or (
                w.layer in self.retained and self.versions[w.layer] == w.version)
            return copied and (not self.gate_on_step or self.step >= w.version)
        return self.ready(w.layer, w.version)

    def waits_for_copy(self, layer: int) -> bool:
        """Someone waits for the retained copy of ``layer``'s current version."""
        return any(w.retained and w.layer == layer for w in self._waiters)

    def drop(self, peer: bytes | None = None) -> list[Waiter]:
        """Remove and return the waiters of ``peer`` (of everyone if None)."""
        gone = [w for w in self._waiters if peer is None or w.peer == peer]
        self._waiters = [w for w in self._waiters if not (peer is None or w.peer == peer)]
        return gone
