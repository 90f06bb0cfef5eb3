"""Layer versions and the Fetches waiting for them (event-loop side, no math).

``versions[l]`` counts the updates applied to layer l (-1 before its initial values arrive);
step t reads version t. A Fetch for (l, v) is answered once the layer has reached v and, when
the answer must carry step v's fp16 loss scale, once every layer has (step v-1 is complete, so
the scale is decided). Layers whose update is pending are marked: nobody may read their
current version any more.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


class VersionError(Exception):
    """A waiting Fetch that can no longer be answered (``code`` as in protocol Error)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class _Waiter:
    layer: int
    version: int
    future: asyncio.Future
    peer: bytes


class VersionBoard:
    def __init__(self, store, gate_on_step: bool):
        self.store = store
        self.versions = store.versions  # read here, written through store.set_version
        self.gate_on_step = gate_on_step
        self.updating: set[int] = set()
        self._waiters: list[_Waiter] = []
        self.changed = asyncio.Condition()

    @property
    def step(self) -> int:
        """Steps completed by every layer."""
        return min(self.versions)

    def ready(self, layer: int, version: int) -> bool:
        return self.versions[layer] >= version and (not self.gate_on_step
                                                    or self.step >= version)

    async def wait(self, peer: bytes, layer: int, version: int) -> int:
        if not self.ready(layer, version):
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(_Waiter(layer, version, fut, peer))
            await fut
        return self.versions[layer]

    def set(self, layer: int, version: int) -> bool:
        """Record a layer's new version, answer whoever it unblocks; True if a step completed."""
        before = self.step
        self.store.set_version(layer, version)
        still = []
        for w in self._waiters:
            if w.future.done():
                continue
            if self.ready(w.layer, w.version):
                w.future.set_result(None)
            else:
                still.append(w)
        self._waiters = still
        asyncio.get_running_loop().create_task(self._notify())
        return self.step > before

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait_for_step(self, step: int) -> None:
        """Until every layer is at exactly ``step`` (a step boundary)."""
        async with self.changed:
            await self.changed.wait_for(lambda: self.step == step)

    def fail(self, peer: bytes | None, code: str, message: str) -> None:
        """Fail the waiting Fetches of ``peer`` (of everyone if None)."""
        for w in self._waiters:
            if (peer is None or w.peer == peer) and not w.future.done():
                w.future.set_exception(VersionError(code, message))
