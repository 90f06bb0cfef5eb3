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
  one layer plan addresses all of them;
- a *tied* tensor (``tie=(layer, tensor)``: it is that earlier layer's tensor, e.g. an LM head
  reading the token embedding) has no storage in its reader: one copy, one optimizer state,
  in its owner. The worker adds the reader's gradient into the owner's before pushing it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgpack

if TYPE_CHECKING:
    import torch

# 128 elements = 256 bytes at 2-byte dtypes, 512 at fp32: kernel-friendly views in every dtype.
ALIGN_ELEMS = 128

# The floating dtypes a layout holds, by name, with their bytes per element. torch's dtypes
# (DTYPES) load with torch, on first use: the launcher and l2l-ctl need only the names, and
# importing torch costs seconds of CPU per process.
ITEMSIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _dtypes() -> dict:
    if "DTYPES" not in globals():
        import torch

        globals()["DTYPES"] = {n: getattr(torch, n) for n in ITEMSIZES}
    return globals()["DTYPES"]


def __getattr__(name: str):
    if name == "DTYPES":
        return _dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Optimizer groups, in layout order. "no_decay" is for biases, norms and embeddings' norms;
# "frozen" tensors (--freeze) are served but never pushed or updated: last in each layer, so
# a layer's trainable elements are one prefix of its span (``LayerPlan.trainable``).
GROUPS = ("decay", "no_decay", "frozen")

MAX_NAME_LEN = 200
MAX_TENSORS_PER_LAYER = 4096
MAX_LAYERS = 100_000
MAX_DIMS = 8
MAX_NUMEL = 1 << 40


def dtype_of(name: str) -> torch.dtype:
    itemsize(name)  # a clear error for a name that is not a layout dtype
    return _dtypes()[name]


def itemsize(name: str) -> int:
    try:
        return ITEMSIZES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(ITEMSIZES)}") from None


def _align(n: int) -> int:
    return (n + ALIGN_ELEMS - 1) // ALIGN_ELEMS * ALIGN_ELEMS


def _check_name(what: str, name: str) -> None:
    if not isinstance(name, str) or not (0 < len(name) <= MAX_NAME_LEN):
        raise ValueError(f"{what} must be a non-empty string of at most {MAX_NAME_LEN} chars")


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor of a layer, e.g. ``attn.qkv.weight``; ``dtype`` is the master dtype.
    ``tie``: (layer, tensor) of an earlier layer whose tensor this one is (no storage here)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    group: str = "decay"
    tie: tuple[str, str] | None = None

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
        if all(t.tie is not None for t in self.tensors):
            raise ValueError(f"layer {self.name!r}: needs a tensor of its own (all are tied)")


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
        index = {name: i for i, name in enumerate(names)}
        for i, layer in enumerate(self.layers):
            for t in layer.tensors:
                if t.tie is not None:
                    _check_tie(self, index, i, layer, t)

    def canonical(self) -> bytes:
        """Deterministic bytes of the manifest (msgpack, sorted meta keys); a tied tensor's
        entry gets its tie as a fifth item."""
        body = [
            [[la.name, la.kind, [[t.name, list(t.shape), t.dtype, t.group]
                                 + ([list(t.tie)] if t.tie is not None else [])
                                 for t in la.tensors]]
             for la in self.layers],
            sorted(self.meta.items()),
        ]
        return msgpack.packb(body, use_bin_type=True)

    def hash(self) -> str:
        """sha256 of canonical(), worked out once (a large manifest's takes ~0.1 s): the EPS
        checks the Hellos of one manifest, decoded once (codec), against their claimed hash."""
        known = self.__dict__.get("_hash")
        if known is None:
            known = "sha256:" + hashlib.sha256(self.canonical()).hexdigest()
            object.__setattr__(self, "_hash", known)
        return known

    @property
    def num_params(self) -> int:
        """Distinct parameters (a tied tensor counts once)."""
        return sum(t.numel for la in self.layers for t in la.tensors if t.tie is None)


def _check_tie(m: Manifest, index: dict[str, int], i: int, layer: LayerSpec,
               t: TensorSpec) -> None:
    """A tie names an earlier layer's own tensor of the same shape: the reader is visited after
    its owner in the forward pass and before it in the backward pass, so the owner's version is
    still current when the reader uses it, and its gradient is complete when the owner pushes."""
    owner_name, tensor_name = t.tie
    where = f"layer {layer.name!r} tensor {t.name!r}"
    if index.get(owner_name, i) >= i:
        raise ValueError(f"{where}: tied to {owner_name!r}, which is not an earlier layer")
    owner = {o.name: o for o in m.layers[index[owner_name]].tensors}.get(tensor_name)
    if owner is None or owner.tie is not None:
        raise ValueError(f"{where}: layer {owner_name!r} has no tensor {tensor_name!r} of its own")
    if owner.shape != t.shape:
        raise ValueError(f"{where}: shape {t.shape} differs from the tied {owner.shape}")


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor sits inside its layer's flat buffer (offset in elements)."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    group: str


@dataclass(frozen=True)
class TiedSlot:
    """A tensor of this layer stored in an earlier layer (``owner``'s ``tensor``)."""

    name: str
    shape: tuple[int, ...]
    owner: int
    tensor: str


@dataclass(frozen=True)
class LayerPlan:
    """The flat layout of one layer: its span in a region and where each tensor/group sits."""

    index: int
    name: str
    kind: str
    offset: int  # first element of the layer in the region
    numel: int  # aligned element count of the layer (its span)
    tensors: tuple[TensorSlot, ...]  # its own tensors, in manifest order
    groups: dict[str, tuple[int, int]]  # group -> (start, end) elements, relative to the layer
    ties: tuple[TiedSlot, ...] = ()  # tensors it reads from earlier layers

    def nbytes(self, dtype: str) -> int:
        return self.numel * itemsize(dtype)

    @property
    def trainable(self) -> int:
        """Elements of the span that are trained (pushed, updated): a prefix, the frozen
        tensors after it."""
        return self.groups["frozen"][0] if "frozen" in self.groups else self.numel

    @property
    def frozen_names(self) -> frozenset[str]:
        """The names of its frozen tensors (after the trainable prefix)."""
        return frozenset(s.name for s in self.tensors if s.group == "frozen")

    def byte_offset(self, dtype: str) -> int:
        return self.offset * itemsize(dtype)


@dataclass(frozen=True)
class Layout:
    layers: tuple[LayerPlan, ...]
    total_numel: int  # elements of the whole region

    @property
    def max_layer_numel(self) -> int:
        return max(p.numel for p in self.layers)

    @property
    def max_trainable_numel(self) -> int:
        """The largest trainable prefix: a gradient slot's elements (a LoRA or --freeze job
        pushes its trained tensors only, far fewer than a layer holds)."""
        return max(1, max(p.trainable for p in self.layers))

    @property
    def frozen(self) -> bool:
        """Some tensor is frozen (the master trains the trainable prefixes only)."""
        return any(p.trainable < p.numel for p in self.layers)

    def nbytes(self, dtype: str) -> int:
        return self.total_numel * itemsize(dtype)


def plan_layout(manifest: Manifest) -> Layout:
    """The flat layout both sides derive from a manifest (pure function, see module doc)."""
    plans = []
    region_offset = 0
    index_of = {layer.name: i for i, layer in enumerate(manifest.layers)}
    for index, layer in enumerate(manifest.layers):
        pos = 0
        slots: dict[str, TensorSlot] = {}
        groups: dict[str, tuple[int, int]] = {}
        for group in GROUPS:
            start = pos
            for t in layer.tensors:
                if t.group == group and t.tie is None:
                    slots[t.name] = TensorSlot(t.name, t.shape, pos, t.numel, group)
                    pos = _align(pos + t.numel)
            if pos > start:
                groups[group] = (start, pos)
        ordered = tuple(slots[t.name] for t in layer.tensors if t.tie is None)
        ties = tuple(TiedSlot(t.name, t.shape, index_of[t.tie[0]], t.tie[1])
                     for t in layer.tensors if t.tie is not None)
        plans.append(LayerPlan(index, layer.name, layer.kind, region_offset, pos, ordered, groups,
                               ties))
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
                if ta.tie != tb.tie:
                    return (f"layer {a.name!r} tensor {ta.name!r} tied to {ta.tie} vs "
                            f"server {tb.tie}")
                if ta != tb:
                    hint = (" (--freeze or the LoRA options differ from those the server's "
                            "model was made with)" if "frozen" in (ta.group, tb.group)
                            and ta.group != tb.group else "")
                    return f"layer {a.name!r} tensor {_said(ta)} vs server {_said(tb)}{hint}"
            if len(a.tensors) != len(b.tensors):
                more, fewer, where = ((a, b, "the server's") if len(a.tensors) > len(b.tensors)
                                      else (b, a, "this"))
                return (f"layer {a.name!r}: tensor {more.tensors[len(fewer.tensors)].name!r} "
                        f"is not in {where} model ({len(a.tensors)} tensors vs server "
                        f"{len(b.tensors)})")
            if a.kind != b.kind:
                return f"layer {a.name!r} is a {a.kind!r} vs server {b.kind!r}"
            return f"layer {a.name!r} differs"
    return ""


def _said(t: TensorSpec) -> str:
    """A tensor as a manifest difference names it: what sets it apart."""
    extra = [t.group] if t.group != "decay" else []
    return " ".join([repr(t.name), str(t.shape), *extra, *([t.dtype] if t.dtype != "float32"
                                                           else [])])


def views(flat: torch.Tensor, plan: LayerPlan) -> list[torch.Tensor]:
    """Per-tensor views (manifest order) of one layer's flat buffer (its own tensors)."""
    return [flat[s.offset:s.offset + s.numel].view(s.shape) for s in plan.tensors]


def named_views(flat: torch.Tensor, plan: LayerPlan, names=None) -> dict[str, torch.Tensor]:
    """{tensor name: view} of one layer's flat buffer (its own tensors; ``names``: those, in
    that order, e.g. the trained ones in a gradient, which holds the trainable prefix only)."""
    slots = plan.tensors
    if names is not None:
        by_name = {s.name: s for s in slots}
        slots = [by_name[n] for n in names]
    return {s.name: flat[s.offset:s.offset + s.numel].view(s.shape) for s in slots}


def manifest_to_json(m: Manifest) -> dict:
    return {"layers": [{"name": la.name, "kind": la.kind,
                        "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype,
                                     "group": t.group,
                                     **({"tie": list(t.tie)} if t.tie is not None else {})}
                                    for t in la.tensors]}
                       for la in m.layers],
            "meta": dict(m.meta)}


def manifest_from_json(d: dict) -> Manifest:
    return Manifest(
        layers=tuple(LayerSpec(name=la["name"], kind=la["kind"], tensors=tuple(
            TensorSpec(name=t["name"], shape=tuple(t["shape"]), dtype=t["dtype"],
                       group=t["group"], tie=tuple(t["tie"]) if t.get("tie") else None)
            for t in la["tensors"])) for la in d["layers"]),
        meta=d.get("meta", {}))
