"""Tensor descriptors shared by both sides: the model manifest, its hash, and the flat layout.

The EPS is model-agnostic: all it knows of a model is its *manifest*, an ordered list of layers,
each an ordered list of named tensors with a shape, a dtype and an optimizer group. Both sides
derive the same flat layout from the manifest (`plan_layout`), so a control message only has to
name a layer: every tensor's offset follows from the manifest alone.

Layout rules (see SPEC.md, "Flat layout"):
- within a layer, tensors are ordered by optimizer group (GROUPS order), manifest order inside a
  group, each starting at a multiple of ALIGN_ELEMS elements;
- each group is one contiguous span, so one fused optimizer call updates a whole group;
- each layer starts at a multiple of ALIGN_ELEMS elements; padding elements are zero forever;
- offsets are in *elements*, identical for every dtype (fp32 master, bf16 copy, grad slots), so
  one layer plan addresses all of them.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import msgpack
import torch

# 128 elements = 256 bytes at 2-byte dtypes, 512 at fp32: kernel-friendly views in every dtype.
ALIGN_ELEMS = 128

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# Optimizer groups, in layout order. "no_decay" is for biases, norms and embeddings' norms.
GROUPS = ("decay", "no_decay")

MAX_NAME_LEN = 200
MAX_TENSORS_PER_LAYER = 4096
MAX_LAYERS = 100_000
MAX_DIMS = 8
MAX_NUMEL = 1 << 40


def dtype_of(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}") from None


def itemsize(name: str) -> int:
    return dtype_of(name).itemsize


def _align(n: int) -> int:
    return (n + ALIGN_ELEMS - 1) // ALIGN_ELEMS * ALIGN_ELEMS


def _check_name(what: str, name: str) -> None:
    if not isinstance(name, str) or not (0 < len(name) <= MAX_NAME_LEN):
        raise ValueError(f"{what} must be a non-empty string of at most {MAX_NAME_LEN} chars")


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor of a layer, e.g. ``attn.qkv.weight``; ``dtype`` is the master dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    group: str = "decay"

    def __post_init__(self) -> None:
        _check_name("tensor name", self.name)
        if len(self.shape) > MAX_DIMS or any(
            (not isinstance(d, int)) or isinstance(d, bool) or d <= 0 for d in self.shape
        ):
            raise ValueError(f"tensor {self.name!r}: shape must be <= {MAX_DIMS} positive ints")
        if self.dtype != "float32":
            raise ValueError(f"tensor {self.name!r}: master dtype must be float32")
        if self.group not in GROUPS:
            raise ValueError(f"tensor {self.name!r}: group must be one of {GROUPS}")
        if self.numel > MAX_NUMEL:
            raise ValueError(f"tensor {self.name!r}: too many elements")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class LayerSpec:
    """One layer (a visit unit of L2L): a name, the stage kind that computes it, its tensors."""

    name: str
    kind: str
    tensors: tuple[TensorSpec, ...]

    def __post_init__(self) -> None:
        _check_name("layer name", self.name)
        _check_name("layer kind", self.kind)
        if not (0 < len(self.tensors) <= MAX_TENSORS_PER_LAYER):
            raise ValueError(f"layer {self.name!r}: needs 1..{MAX_TENSORS_PER_LAYER} tensors")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"layer {self.name!r}: duplicate tensor names")


@dataclass(frozen=True)
class Manifest:
    """The whole model as the EPS sees it. ``meta`` (architecture facts) is part of the hash."""

    layers: tuple[LayerSpec, ...]
    meta: dict[str, str | int | float | bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (0 < len(self.layers) <= MAX_LAYERS):
            raise ValueError(f"manifest needs 1..{MAX_LAYERS} layers")
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError("manifest: duplicate layer names")

    def canonical(self) -> bytes:
        """Deterministic bytes of the manifest (msgpack, sorted meta keys)."""
        body = [
            [[la.name, la.kind, [[t.name, list(t.shape), t.dtype, t.group] for t in la.tensors]]
             for la in self.layers],
            sorted(self.meta.items()),
        ]
        return msgpack.packb(body, use_bin_type=True)

    def hash(self) -> str:
        return "sha256:" + hashlib.sha256(self.canonical()).hexdigest()

    @property
    def num_params(self) -> int:
        return sum(t.numel for la in self.layers for t in la.tensors)


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor sits inside its layer's flat buffer (offset in elements)."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    group: str


@dataclass(frozen=True)
class LayerPlan:
    """The flat layout of one layer: its span in a region and where each tensor/group sits."""

    index: int
    name: str
    kind: str
    offset: int  # first element of the layer in the region
    numel: int  # aligned element count of the layer (its span)
    tensors: tuple[TensorSlot, ...]  # in manifest order
    groups: dict[str, tuple[int, int]]  # group -> (start, end) elements, relative to the layer

    def nbytes(self, dtype: str) -> int:
        return self.numel * itemsize(dtype)

    def byte_offset(self, dtype: str) -> int:
        return self.offset * itemsize(dtype)


@dataclass(frozen=True)
class Layout:
    layers: tuple[LayerPlan, ...]
    total_numel: int  # elements of the whole region

    @property
    def max_layer_numel(self) -> int:
        return max(p.numel for p in self.layers)

    def nbytes(self, dtype: str) -> int:
        return self.total_numel * itemsize(dtype)


def plan_layout(manifest: Manifest) -> Layout:
    """The flat layout both sides derive from a manifest (pure function, see module doc)."""
    plans = []
    region_offset = 0
    for index, layer in enumerate(manifest.layers):
        pos = 0
        slots: dict[str, TensorSlot] = {}
        groups: dict[str, tuple[int, int]] = {}
        for group in GROUPS:
            start = pos
            for t in layer.tensors:
                if t.group == group:
                    slots[t.name] = TensorSlot(t.name, t.shape, pos, t.numel, group)
                    pos = _align(pos + t.numel)
            if pos > start:
                groups[group] = (start, pos)
        ordered = tuple(slots[t.name] for t in layer.tensors)
        plans.append(LayerPlan(index, layer.name, layer.kind, region_offset, pos, ordered, groups))
        region_offset += pos
    return Layout(tuple(plans), region_offset)


def manifest_difference(ours: Manifest, theirs: Manifest) -> str:
    """The first difference between two manifests, for people ("" if they are equal)."""
    if len(theirs.layers) != len(ours.layers):
        return f"{len(theirs.layers)} layers vs {len(ours.layers)}"
    if theirs.meta != ours.meta:
        keys = sorted(k for k in set(theirs.meta) | set(ours.meta)
                      if theirs.meta.get(k) != ours.meta.get(k))
        return "model settings differ: " + ", ".join(
            f"{k}={theirs.meta.get(k)!r} (server {ours.meta.get(k)!r})" for k in keys[:5])
    for a, b in zip(theirs.layers, ours.layers):
        if a != b:
            for ta, tb in zip(a.tensors, b.tensors):
                if ta != tb:
                    return (f"layer {a.name!r} tensor {ta.name!r} {ta.shape} vs "
                            f"server {tb.name!r} {tb.shape}")
            return f"layer {a.name!r} differs"
    return ""


def views(flat: torch.Tensor, plan: LayerPlan) -> list[torch.Tensor]:
    """Per-tensor views (manifest order) of one layer's flat buffer."""
    return [flat[s.offset:s.offset + s.numel].view(s.shape) for s in plan.tensors]

