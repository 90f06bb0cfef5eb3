"""A checkpoint's tensors, whichever way it was written (shared: the EPS loads them,
``l2l-export`` exports them):

- by one EPS (one box, or ``--eps-mode replicate``): ``master.safetensors`` ("<layer>/<tensor>"
  with its real shape) and ``optimizer.safetensors`` ("<layer>/<state>", flat over the layer);
- by the N boxes of an ``--eps-mode shard`` job together (state.json ``"shards": N``): box r's
  ``master-<r>-of-<N>.safetensors`` ("<layer>/master") and
  ``optimizer-<r>-of-<N>.safetensors`` ("<layer>/<state>"), each the box's span of the layer's
  flat elements (protocol.shards), one metadata set for the whole (manifest.json, state.json,
  checksums.json covering every file).

A reader asks for one layer at a time, as flat fp32 tensors over the layer's span: a job with
any number of boxes takes its own part of them (a 2-box checkpoint loads into 1 box or 3).
"""

from __future__ import annotations

import os

import torch

from .safetensors_io import SafetensorsFile
from .shards import Sharding
from .tensors import LayerPlan, views


def shard_files(rank: int, count: int) -> tuple[str, str]:
    return (f"master-{rank:05d}-of-{count:05d}.safetensors",
            f"optimizer-{rank:05d}-of-{count:05d}.safetensors")


class CheckpointTensors:
    def __init__(self, path: str, state: dict):
        self.path = path
        self.shards = int(state.get("shards", 0))  # 0: written whole by one EPS
        names = ([shard_files(r, self.shards) for r in range(self.shards)] if self.shards
                 else [("master.safetensors", "optimizer.safetensors")])
        self._master = [SafetensorsFile(os.path.join(path, m)) for m, _ in names]
        self._optimizer = [SafetensorsFile(os.path.join(path, o)) for _, o in names]

    def master(self, plan: LayerPlan) -> torch.Tensor:
        """The layer's fp32 master, flat over its span (zeros between its tensors; frozen
        tensors as they were served)."""
        flat = torch.zeros(plan.numel, dtype=torch.float32)
        if not self.shards:
            f = self._master[0]
            for slot, view in zip(plan.tensors, views(flat, plan)):
                t = f.get(f"{plan.name}/{slot.name}")
                if tuple(t.shape) != slot.shape:
                    raise ValueError(f"checkpoint tensor {plan.name}/{slot.name} has shape "
                                     f"{tuple(t.shape)}, expected {slot.shape}")
                view.copy_(t)
            return flat
        self._assemble(self._master, plan, "master", flat[:plan.trainable])
        for slot in plan.tensors:  # --freeze: box 0's file holds the frozen tensors whole
            if slot.group == "frozen":
                flat[slot.offset:slot.offset + slot.numel].view(slot.shape).copy_(
                    self._master[0].get(f"{plan.name}/{slot.name}"))
        return flat

    def master_tensors(self, plan: LayerPlan) -> dict[str, torch.Tensor]:
        """The layer's tensors with their real shapes (name -> fp32 tensor)."""
        flat = self.master(plan)
        return {slot.name: view for slot, view in zip(plan.tensors, views(flat, plan))}

    def optimizer(self, plan: LayerPlan) -> dict[str, torch.Tensor]:
        """The layer's optimizer state: per-element tensors flat over its trainable prefix,
        scalars (the step count) as they are."""
        prefix = f"{plan.name}/"
        keys = [k[len(prefix):] for k in self._optimizer[0].keys() if k.startswith(prefix)]
        if not self.shards:
            return {k: self._optimizer[0].get(prefix + k) for k in keys}
        out = {}
        for k in keys:
            first = self._optimizer[0].get(prefix + k)
            if first.dim() == 0:  # the same on every box
                out[k] = first
                continue
            out[k] = torch.empty(plan.trainable, dtype=first.dtype)
            self._assemble(self._optimizer, plan, k, out[k])
        return out

    def _assemble(self, files: list[SafetensorsFile], plan: LayerPlan, key: str,
                  out: torch.Tensor) -> None:
        cuts = Sharding(0, self.shards)  # (over the trainable prefix: --freeze)
        for r, f in enumerate(files):
            lo, hi = cuts.span(plan.trainable, r)
            name = f"{plan.name}/{key}"
            if name not in f:
                raise ValueError(f"{f.path}: {name} missing")
            t = f.get(name)
            if t.numel() != hi - lo:
                raise ValueError(f"{f.path}: {name} has {t.numel()} elements, the shard "
                                 f"{r} of {self.shards} of a layer of {plan.trainable} has "
                                 f"{hi - lo}")
            out[lo:hi].copy_(t)
