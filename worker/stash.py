"""Where boundary activations (each layer's input, per micro-batch) wait between the forward
and the backward of a step. Only layer boundaries are kept; everything inside a layer is
recomputed in the backward."""

from __future__ import annotations

import torch


class DeviceStash:
    """Keeps the stash on the compute device (fastest; grows with depth x micro-batches)."""

    def __init__(self):
        self._store: dict[tuple[int, int], torch.Tensor] = {}

    def put(self, layer: int, micro_batch: int, x: torch.Tensor) -> None:
        self._store[layer, micro_batch] = x

    def pop(self, layer: int, micro_batch: int) -> torch.Tensor:
        return self._store.pop((layer, micro_batch))

    def clear(self) -> None:
        self._store.clear()

    def __len__(self) -> int:
        return len(self._store)


def make_stash(kind: str):
    if kind == "device":
        return DeviceStash()
    raise ValueError(f"unknown stash placement {kind!r}")
