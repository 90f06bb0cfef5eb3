"""Flat layout (alignment, groups, no overlap), the manifest hash, and shared-memory regions."""

from __future__ import annotations

import os
import stat
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.safetensors_io import write_safetensors
from protocol.shm import Region, list_regions, unlink_prefix
from protocol.tensors import (
    ALIGN_ELEMS,
    GROUPS,
    LayerSpec,
    Manifest,
    TensorSpec,
    plan_layout,
    views,
)

tensors = st.builds(TensorSpec, name=st.from_regex(r"[a-z]{1,8}", fullmatch=True),
                    shape=st.lists(st.integers(1, 300), max_size=3).map(tuple),
                    group=st.sampled_from(GROUPS))
layers = st.lists(tensors, min_size=1, max_size=6, unique_by=lambda t: t.name)


@settings(max_examples=100)
@given(st.lists(layers, min_size=1, max_size=5))
def test_layout_is_aligned_grouped_and_disjoint(tensor_lists):
    m = Manifest(layers=tuple(LayerSpec(name=f"l{i}", kind="k", tensors=tuple(ts))
                              for i, ts in enumerate(tensor_lists)))
    layout = plan_layout(m)
    end = 0
    for plan, spec in zip(layout.layers, m.layers):
        assert plan.offset == end and plan.offset % ALIGN_ELEMS == 0
        spans = sorted((s.offset, s.offset + s.numel, s.group) for s in plan.tensors)
        for (a0, a1, _), (b0, _, _) in zip(spans, spans[1:]):
            assert a1 <= b0  # no overlap
        for s in plan.tensors:
            assert s.offset % ALIGN_ELEMS == 0
            lo, hi = plan.groups[s.group]
            assert lo <= s.offset and s.offset + s.numel <= hi  # inside its group's span
        # groups come in GROUPS order and tile the layer
        present = [g for g in GROUPS if g in plan.groups]
        bounds = [plan.groups[g] for g in present]
        assert bounds[0][0] == 0 and bounds[-1][1] == plan.numel
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert [s.name for s in plan.tensors] == [t.name for t in spec.tensors]
        end += plan.numel
    assert layout.total_numel == end


def test_views_address_each_tensor():
    m = Manifest(layers=(LayerSpec(name="a", kind="k", tensors=(
        TensorSpec(name="b", shape=(3,), group="no_decay"), TensorSpec(name="w", shape=(2, 5)))),))
    plan = plan_layout(m).layers[0]
    flat = torch.zeros(plan.numel)
    b, w = views(flat, plan)
    w.fill_(1)
    b.fill_(2)
    assert flat.sum() == 10 + 6
    assert plan.tensors[1].offset == 0  # decay group first


def test_manifest_hash_depends_on_every_detail():
    base = dict(name="a", kind="k")
    t = TensorSpec(name="w", shape=(4, 4))
    m = Manifest(layers=(LayerSpec(**base, tensors=(t,)),), meta={"hidden": 4})
    variants = [
        Manifest(layers=(LayerSpec(**base, tensors=(TensorSpec(name="w", shape=(4, 5)),)),),
                 meta={"hidden": 4}),
        Manifest(layers=(LayerSpec(**base, tensors=(TensorSpec(name="v", shape=(4, 4)),)),),
                 meta={"hidden": 4}),
        Manifest(layers=(LayerSpec(**base, tensors=(
            TensorSpec(name="w", shape=(4, 4), group="no_decay"),)),), meta={"hidden": 4}),
        Manifest(layers=(LayerSpec(name="a", kind="k2", tensors=(t,)),), meta={"hidden": 4}),
        Manifest(layers=(LayerSpec(**base, tensors=(t,)),), meta={"hidden": 5}),
    ]
    assert len({m.hash(), *(v.hash() for v in variants)}) == 1 + len(variants)
    assert m.hash() == Manifest(layers=(LayerSpec(**base, tensors=(t,)),),
                                meta={"hidden": 4}).hash()


@pytest.fixture
def region_name():
    name = f"l2l-test-{os.getpid()}"
    yield name
    unlink_prefix(name)


def test_region_owner_only_and_shared(region_name):
    r = Region.create(region_name, 4096)
    try:
        mode = os.stat(f"/dev/shm/{region_name}").st_mode
        assert stat.S_IMODE(mode) == 0o600
        r.tensor(torch.float32)[:4] = torch.arange(4.0)
        a = Region.attach(region_name, 4096, writable=False)
        assert a.tensor(torch.float32)[:4].tolist() == [0, 1, 2, 3]
        with pytest.raises(ValueError):
            Region.attach(region_name, 8192)  # size mismatch is refused
        with pytest.raises(ValueError):
            r.tensor(torch.float32, 1020, 8)  # view beyond the region
        a.close()
    finally:
        r.unlink()
        r.close()
    assert region_name not in list_regions("l2l-test-")


@pytest.mark.parametrize("read_only_ok", [True, False, None])
def test_weights_are_pinned_through_a_shared_mapping_the_gpu_can_register(
        region_name, monkeypatch, read_only_ok):
    """A GPU that cannot register read-only memory (cudaDevAttrHostRegisterReadOnlySupported
    0, or unknown and refused) gets the weights mapped writable and shared, so the pinned
    pages are the EPS's live ones; one that can gets a read-only mapping. Mappings the GPU does
    not copy are never registered, nor re-mapped."""
    import worker.regions as regions_mod
    from protocol.messages import RegionInfo

    calls = []
    monkeypatch.setattr(regions_mod, "read_only_registration_supported",
                        lambda device: read_only_ok)
    monkeypatch.setattr(regions_mod, "register_host",
                        lambda t, read_only: calls.append(read_only) or True)
    monkeypatch.setattr(regions_mod, "unregister_host", lambda t: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    owner = Region.create(region_name, 4096)
    other = Region.create(region_name + "-b", 4096)
    try:
        regions = regions_mod.Regions(pin=True, device=torch.device("cpu"))
        weights = regions.attach(RegionInfo(name=region_name, nbytes=4096, dtype="float32"),
                                 writable=False)
        unpinned = regions.attach(RegionInfo(name=region_name + "-b", nbytes=4096,
                                             dtype="float32"), writable=False, pin=False)
        assert weights.writable is (read_only_ok is False) and not unpinned.writable
        assert calls == [read_only_ok is not False] and regions.registered == 1
        owner.tensor(torch.float32)[:2] = torch.tensor([1.0, 2.0])  # the EPS updates a layer
        assert weights.tensor(torch.float32)[:2].tolist() == [1.0, 2.0]  # seen: shared
        regions.close()
    finally:
        for r in (owner, other):
            r.unlink()
            r.close()


def test_attach_refuses_a_region_others_can_read(region_name):
    r = Region.create(region_name, 64)
    try:
        os.chmod(f"/dev/shm/{region_name}", 0o644)
        with pytest.raises(PermissionError):
            Region.attach(region_name, 64)
    finally:
        r.unlink()
        r.close()


def test_bad_region_names_are_refused():
    for bad in ("", "../etc/passwd", "a/b", "x" * 300):
        with pytest.raises(ValueError):
            Region.attach(bad, 1)


def test_unlink_prefix_removes_only_matching(region_name):
    a = Region.create(region_name + "-a", 64)
    b = Region.create(region_name + "-b", 64)
    assert unlink_prefix(region_name + "-a") == [region_name + "-a"]
    assert list_regions(region_name) == [region_name + "-b"]
    b.unlink()
    a.close()
    b.close()


def test_streaming_safetensors_reads_back(tmp_path):
    from safetensors.torch import load_file

    base = torch.arange(20, dtype=torch.float32)
    items = [("a", base[:6].view(2, 3)), ("b", base[8:12]), ("s", torch.tensor(3.0)),
             ("h", torch.ones(3, dtype=torch.bfloat16)), ("m", torch.tensor([True, False])),
             ("q", (base[:4] / 7).to(torch.float8_e4m3fn)), ("d", base[:2].double())]
    write_safetensors(str(tmp_path / "x.safetensors"), items, {"k": "v"})
    got = load_file(str(tmp_path / "x.safetensors"))
    for name, t in items:
        assert got[name].dtype == t.dtype and torch.equal(got[name].float(), t.float())
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]
    # in a dtype, but for the names kept in their own
    write_safetensors(str(tmp_path / "y.safetensors"), items[:3], dtype=torch.bfloat16,
                      keep={"b"})
    got = load_file(str(tmp_path / "y.safetensors"))
    assert [got[n].dtype for n in "abs"] == [torch.bfloat16, torch.float32, torch.bfloat16]
    assert torch.equal(got["b"], base[8:12]) and torch.equal(got["a"], items[0][1].bfloat16())


def test_the_digest_is_the_files_sha256_taken_as_it_is_written(tmp_path, monkeypatch):
    """Hashed chunk by chunk on a thread of its own while the next chunks are written (chunks
    of 64 bytes here: a tensor spans several, the header and a non-contiguous view others)."""
    import hashlib

    from protocol import safetensors_io

    monkeypatch.setattr(safetensors_io, "CHUNK", 64)
    items = [("a", torch.randn(100)), ("t", torch.randn(7, 5).T), ("e", torch.zeros(0)),
             ("h", torch.randn(33).bfloat16())]
    path = tmp_path / "x.safetensors"
    digest = write_safetensors(str(path), items, {"k": "v"}, digest=True)
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    assert write_safetensors(str(path), items) is None  # (no digest asked for: no hashing)

    class Broken:  # a tensor that fails once the first ones are written and being hashed
        dtype, shape = torch.float32, (4,)

        def numel(self):
            return 4

        def element_size(self):
            return 4

        def detach(self):
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_safetensors(str(tmp_path / "y.safetensors"), [*items, ("z", Broken())],
                          digest=True)
    assert sorted(os.listdir(tmp_path)) == ["x.safetensors"]  # its partial file is gone
    assert not [t for t in threading.enumerate() if t.name.startswith("sha256")]


def test_a_region_larger_than_shared_memory_is_refused_cleanly(region_name):
    with pytest.raises(OSError, match="shared memory"):
        Region.create(region_name, 1 << 50)  # reserved up front: no SIGBUS on first touch
    assert region_name not in list_regions(region_name)


def test_mapped_safetensors_reads_views_of_the_file(tmp_path):
    from safetensors.torch import save_file

    from protocol.safetensors_io import SafetensorsFile

    tensors = {"a": torch.randn(3, 4), "b": torch.randn(5).bfloat16(),
               "c": torch.arange(6, dtype=torch.int64).view(2, 3), "e": torch.zeros(0, 4)}
    save_file(tensors, tmp_path / "x.safetensors")
    f = SafetensorsFile(str(tmp_path / "x.safetensors"))
    assert sorted(f.keys()) == sorted(tensors)
    for k, v in tensors.items():
        assert f.get(k).dtype == v.dtype and torch.equal(f.get(k), v)
    a, again = f.get("a"), f.get("a")
    assert a.data_ptr() == again.data_ptr()  # two views of the same mapped bytes, no copies
    a.zero_()  # copy-on-write: the file is not changed
    assert torch.equal(SafetensorsFile(str(tmp_path / "x.safetensors")).get("a"),
                       tensors["a"])
    (tmp_path / "bad").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="not a safetensors file"):
        SafetensorsFile(str(tmp_path / "bad"))


def test_a_received_frame_reads_as_a_tensor_even_empty():
    """A layer's bytes as a ZeroMQ frame delivers them; an empty frame (the trained part of a
    layer that trains nothing) is an empty tensor, not torch.frombuffer's error."""
    import zmq

    from worker.regions import frombuffer

    values = torch.arange(6, dtype=torch.float32)
    assert torch.equal(frombuffer(zmq.Frame(values.numpy().tobytes()), torch.float32), values)
    empty = frombuffer(zmq.Frame(b""), torch.bfloat16)
    assert empty.dtype == torch.bfloat16 and empty.numel() == 0
