"""The model's weights in shared memory: fp32 master, compute copy, versions, gradient slots.

Regions (all created by the EPS, mode 0600, unlinked by the EPS alone; every name ends with a
random part, ``-<x>``, so nobody can create one first to make the EPS fail):
  l2l-<run>-master-<x>    fp32 master of every layer's trainable prefix (--freeze, LoRA), in
                          the flat layout of protocol.tensors (--eps-mode shard: this box's
                          span of each, back to back); in fp32 unsharded, every layer whole
                          (frozen tensors too), served as it is
  l2l-<run>-compute-<x>   the served copy, whole (bf16/fp16; in fp32 only in shard mode)
  l2l-<run>-grads-r<k>-<dtype>-<x>  rank k's gradient slots, ``grad_slots`` x the largest
                          trainable prefix
  l2l-<run>-stash-r<k>-<x>  rank k's stash arena (``--stash eps``), sized by the worker
  l2l-<run>-retained-<x>  (--recovery) each layer's previous served version, copied just
                          before an update: what a worker replacing a dead one reads to redo
                          the step it was in, when the layer was already updated in that step

Versions: ``versions[l]`` is the number of optimizer steps applied to layer l (-1 before its
initial values arrive). Step t of training reads version t of every layer. Layer l is only ever
rewritten after every worker pushed its step-t gradient of l, i.e. after every worker is done
reading version t, so one copy per layer is enough for synchronous data parallelism. Versions
are mirrored, int64 per layer, in ``l2l-<run>-versions``: a worker reading shared memory in
place sees that a version exists without asking.
"""

from __future__ import annotations

import logging
import secrets

import torch

from protocol.messages import RegionInfo
from protocol.shards import Sharding, master_spans, serves_master, shard_plan
from protocol.shm import Region
from protocol.tensors import DTYPES, LayerPlan, Manifest, plan_layout

log = logging.getLogger(__name__)


class LayerStore:
    def __init__(self, manifest: Manifest, run_id: str, compute_dtype: str,
                 retain: bool = False, sharding: Sharding | None = None):
        self.manifest = manifest
        self.manifest_hash = manifest.hash()
        self.layout = plan_layout(manifest)
        self.run_id = run_id
        self.compute_dtype = compute_dtype
        # In fp32 unsharded, the master is laid out whole and served as it is, frozen tensors
        # included (the optimizer sees each layer's trainable prefix only). Otherwise the
        # master holds each layer's trainable prefix (--freeze: frozen tensors only in the
        # served copy) or, --eps-mode shard, this box's span of it (protocol/shards.py), back
        # to back, and the served copy is whole (in shard mode also in fp32).
        self.sharding = sharding
        self.spans = master_spans(self.layout.layers, sharding)
        separate = not serves_master(compute_dtype, sharding)
        self.shard_plans = []
        offset = 0
        for p, (lo, hi) in zip(self.layout.layers, self.spans):
            offset = offset if separate else p.offset
            whole = (lo, hi) == (0, p.numel) and offset == p.offset
            self.shard_plans.append(p if whole else shard_plan(p, lo, hi, offset))
            offset += hi - lo
        offset = offset if separate else self.layout.total_numel
        self.versions = [-1] * len(self.layout.layers)
        self._regions: list[Region] = []
        self._grad_regions: dict[int, Region] = {}
        self._stash_regions: dict[int, Region] = {}
        try:
            self.master_region = self._create("master", 4 * max(1, offset))
            self.compute_region = (self._create("compute", self.layout.nbytes(compute_dtype))
                                   if separate else None)
            self.versions_region = self._create("versions", 8 * len(self.layout.layers))
            self.retained_region = (self._create("retained", self.layout.nbytes(compute_dtype))
                                    if retain else None)
        except BaseException:
            self.close()  # no region left behind by a store that could not be made
            raise
        self._version_board = self.versions_region.tensor(torch.int64)
        self._version_board.fill_(-1)
        self._master = self.master_region.tensor(torch.float32)
        self._compute = (self._master if self.compute_region is None
                         else self.compute_region.tensor(DTYPES[compute_dtype]))
        self._retained = (None if self.retained_region is None
                          else self.retained_region.tensor(DTYPES[compute_dtype]))

    def _create(self, suffix: str, nbytes: int) -> Region:
        region = Region.create(f"l2l-{self.run_id}-{suffix}-{secrets.token_hex(4)}", nbytes)
        self._regions.append(region)
        return region

    # -- layers ---------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layout.layers)

    def plan(self, layer: int) -> LayerPlan:
        return self.layout.layers[layer]

    def master(self, layer: int) -> torch.Tensor:
        """The layer's fp32 master (in shard mode: this box's span of it)."""
        p = self.shard_plans[layer]
        return self._master[p.offset:p.offset + p.numel]

    def compute(self, layer: int) -> torch.Tensor:
        """The layer's served copy, whole."""
        p = self.layout.layers[layer]
        return self._compute[p.offset:p.offset + p.numel]

    @property
    def whole_master(self) -> bool:
        """The master region is every layer's whole span (fp32 unsharded; else no shards and
        nothing frozen)."""
        return self.compute_region is None or all(
            p is q for p, q in zip(self.shard_plans, self.layout.layers))

    def compute_shard(self, layer: int) -> torch.Tensor:
        """The part of the served copy that the master's elements are published to."""
        lo, hi = self.spans[layer]
        return self.compute(layer)[lo:hi]

    def write_initial(self, layer: int, data: torch.Tensor,
                      tail: torch.Tensor | None = None) -> None:
        """A layer's initial (or loaded) values: fp32, whole, or (``tail``) its trainable
        prefix in fp32 and its frozen tensors in the compute dtype: the master's span of
        them, and the served copy (in fp32 unsharded, the master itself)."""
        trainable, (lo, hi) = self.plan(layer).trainable, self.spans[layer]
        if tail is None:
            data, tail = data[:trainable], data[trainable:]
        if self.compute_region is not None:
            self.master(layer).copy_(data[lo:hi])
        served = self.compute(layer)
        served[:trainable].copy_(data)
        served[trainable:].copy_(tail)

    @property
    def served_region(self) -> Region:
        """The copy workers compute with: the compute copy, or the master in fp32."""
        return self.compute_region or self.master_region

    def retain(self, layer: int) -> None:
        """Keep the served version of ``layer`` before an update rewrites it (--recovery)."""
        if self._retained is not None:
            p = self.layout.layers[layer]
            self._retained[p.offset:p.offset + p.numel].copy_(self.compute(layer))

    def publish(self, layer: int) -> None:
        """Refresh the compute copy of ``layer`` from its master (no-op for fp32; in shard
        mode, the master's span of it)."""
        if self.compute_region is not None:
            self.compute_shard(layer).copy_(self.master(layer))

    def set_version(self, layer: int, version: int) -> None:
        """Record a layer's version, here and in the shared board. The layer's bytes were
        written before (by the math thread whose completion the caller awaited), and x86 keeps
        stores in order, so a worker that sees the new version sees the new bytes."""
        self.versions[layer] = version
        self._version_board[layer] = version

    def versions_info(self) -> RegionInfo:
        return RegionInfo(name=self.versions_region.name, nbytes=self.versions_region.nbytes,
                          dtype="int64")

    @property
    def initialised(self) -> bool:
        return min(self.versions) >= 0

    @property
    def step(self) -> int:
        """Steps completed by every layer (the lowest version), i.e. the next step to run."""
        return min(self.versions)

    # -- regions --------------------------------------------------------------------------

    def master_info(self) -> RegionInfo:
        return RegionInfo(name=self.master_region.name, nbytes=self.master_region.nbytes,
                          dtype="float32")

    def compute_info(self) -> RegionInfo | None:
        if self.compute_region is None:
            return None
        return RegionInfo(name=self.compute_region.name, nbytes=self.compute_region.nbytes,
                          dtype=self.compute_dtype)

    def retained_info(self) -> RegionInfo | None:
        r = self.retained_region
        return None if r is None else RegionInfo(name=r.name, nbytes=r.nbytes,
                                                 dtype=self.compute_dtype)

    def grad_region(self, rank: int, dtype: str, slots: int, fresh: bool = False) -> Region:
        """Rank's gradient slots; created on first use and kept for a rank that says Hello
        again as long as the size agrees, unless ``fresh`` (the old one is unlinked; mappings
        that reductions still read stay valid until they are done)."""
        nbytes = slots * self.layout.max_trainable_numel * DTYPES[dtype].itemsize
        region = self._grad_regions.get(rank)
        if region is not None and (fresh or region.nbytes != nbytes):
            self._grad_regions.pop(rank)
            self._regions.remove(region)
            region.unlink()
            region.close()
            region = None
        if region is None:
            suffix = f"grads-r{rank}-{dtype}"
            region = self._create(suffix, nbytes)
            self._grad_regions[rank] = region
        return region

    def stash_region(self, rank: int, nbytes: int) -> Region:
        """Rank's stash arena (EPS-owned shared memory for its boundary activations)."""
        old = self._stash_regions.pop(rank, None)
        if old is not None and old.nbytes == nbytes:
            self._stash_regions[rank] = old
            return old
        if old is not None:
            self._regions.remove(old)
            old.unlink()
            old.close()
        region = self._create(f"stash-r{rank}", nbytes)
        self._stash_regions[rank] = region
        return region

    def close(self) -> None:
        """Unlink and unmap every region (idempotent)."""
        for region in self._regions:
            region.unlink()
        for region in self._regions:
            region.close()
        self._regions.clear()
        self._grad_regions.clear()
        self._stash_regions.clear()
