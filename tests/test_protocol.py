"""Wire protocol: every message round-trips; malformed input raises DecodeError, nothing else."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import codec
from protocol.box_info import BOX_STATES, BoxInfo
from protocol.messages import (
    ERROR_CODES,
    REGISTRY,
    Ack,
    ArenaReady,
    Bye,
    Error,
    Fetch,
    GradAck,
    Heartbeat,
    Hello,
    HyperAck,
    InitLayer,
    LayerReady,
    PushGrad,
    RegionInfo,
    Save,
    SetHyper,
    StashArena,
    Status,
    StatusReply,
    Welcome,
    WorkerInfo,
    WorkerReport,
)
from protocol.tensors import GROUPS, LayerSpec, Manifest, TensorSpec

ids = st.integers(0, 2**63 - 1)
small = st.integers(0, 10_000)
names = st.text(st.characters(max_codepoint=0x2FF), min_size=1, max_size=30)
dtypes = st.sampled_from(["float32", "bfloat16", "float16"])
scalars = st.one_of(st.text(max_size=20), st.integers(-(2**62), 2**62),
                    st.floats(allow_nan=False), st.booleans())

tensor_specs = st.builds(TensorSpec, name=names,
                         shape=st.lists(st.integers(1, 64), min_size=0, max_size=4).map(tuple),
                         group=st.sampled_from(GROUPS))
layer_specs = st.builds(
    LayerSpec, name=names, kind=names,
    tensors=st.lists(tensor_specs, min_size=1, max_size=5, unique_by=lambda t: t.name).map(tuple))
manifests = st.builds(
    Manifest, layers=st.lists(layer_specs, min_size=1, max_size=4,
                              unique_by=lambda la: la.name).map(tuple),
    meta=st.dictionaries(st.text(max_size=10), scalars, max_size=4))
regions = st.builds(RegionInfo, name=st.from_regex(r"[a-z0-9-]{1,40}", fullmatch=True),
                    nbytes=small, dtype=dtypes)


@st.composite
def hellos(draw):
    world = draw(st.integers(1, 64))
    return Hello(req_id=draw(ids), protocol_version=draw(small),
                 rank=draw(st.integers(-1, world - 1)), world_size=world,
                 manifest_hash=draw(st.text(max_size=80)), manifest=draw(st.none() | manifests),
                 transport=draw(st.sampled_from(["shm", "frames"])), grad_dtype=draw(dtypes),
                 pid=draw(small), host=draw(st.text(max_size=30).filter(str.isprintable)),
                 role=draw(st.sampled_from(["worker", "observer"])))


seconds = st.floats(0, 1e6)
reports = st.builds(WorkerReport, steps=small, loss=st.floats(allow_nan=False),
                    step_seconds=seconds, fetch_wait=seconds, push_wait=seconds,
                    samples_per_sec=seconds, memory=st.integers(0, 2**50),
                    peak_memory=st.integers(0, 2**50))

SAMPLES = {
    Hello: hellos(),
    Welcome: st.builds(Welcome, req_id=ids, protocol_version=small, run_id=st.text(max_size=10),
                       step=small, init_layers=st.lists(small, max_size=4).map(tuple),
                       compute_dtype=dtypes, grad_dtype=dtypes,
                       master=regions, compute=st.none() | regions, grads=st.none() | regions,
                       grad_slots=small, grad_slot_numel=small, world_size=small,
                       versions=st.none() | regions, retained=st.none() | regions,
                       pushed=st.lists(small, max_size=4).map(tuple), rejoined=st.booleans(),
                       heartbeat_interval=st.floats(0, 1e4), rank=small,
                       optimizer=st.dictionaries(st.text(max_size=8), scalars, max_size=4)),
    Error: st.builds(Error, req_id=ids, code=st.sampled_from(ERROR_CODES),
                     message=st.text(max_size=50), field=st.text(max_size=20)),
    Ack: st.builds(Ack, req_id=ids),
    InitLayer: st.builds(InitLayer, req_id=ids, layer=small, frozen_dtype=dtypes),
    Fetch: st.builds(Fetch, req_id=ids, layer=small, min_version=small,
                     which=st.sampled_from(["compute", "master", "trained"])),
    LayerReady: st.builds(LayerReady, req_id=ids, layer=small, version=small,
                          region=st.text(max_size=20), offset=small, nbytes=small, dtype=dtypes,
                          loss_scale=st.floats(1e-8, 1e8)),
    PushGrad: st.builds(PushGrad, req_id=ids, step=small, layer=small,
                        rank=st.integers(0, 4095), slot=st.integers(-1, 8), dtype=dtypes),
    GradAck: st.builds(GradAck, req_id=ids, step=small, layer=small, slot=st.integers(-1, 8)),
    Save: st.builds(Save, req_id=ids, path=st.text(min_size=1, max_size=40)),
    Status: st.builds(Status, req_id=ids),
    StatusReply: st.builds(StatusReply, req_id=ids, run_id=st.text(max_size=10), step=small,
                           workers=st.lists(st.builds(
                               WorkerInfo, rank=small, pid=small, host=st.text(max_size=10),
                               step=small, silent=st.floats(0, 1e6),
                               report=st.none() | reports), max_size=3).map(tuple),
                           updated_ms=st.lists(st.integers(-1, 2**40), max_size=4).map(tuple),
                           boxes=st.lists(st.builds(
                               BoxInfo, box=st.integers(0, 1023),
                               state=st.sampled_from(BOX_STATES), age=st.floats(-1, 1e6),
                               host=st.text(max_size=10), step=small, newest=small,
                               last_checkpoint=st.integers(-1, 100), lost=st.booleans()),
                               max_size=3).map(tuple),
                           versions=st.lists(small, max_size=5).map(tuple), world_size=small,
                           ranks=st.lists(small, max_size=5).map(tuple),
                           stats=st.dictionaries(st.text(max_size=8),
                                                 st.one_of(st.integers(-(2**63), 2**63 - 1),
                                                           st.floats(allow_nan=False),
                                                           st.text(max_size=8)), max_size=4)),
    Bye: st.builds(Bye, req_id=ids, rank=small, done=st.booleans()),
    StashArena: st.builds(StashArena, req_id=ids, nbytes=st.integers(1, 2**40)),
    ArenaReady: st.builds(ArenaReady, req_id=ids, region=regions),
    SetHyper: st.builds(SetHyper, req_id=ids, changes=st.dictionaries(
        st.text(max_size=8), scalars, min_size=1, max_size=4)),
    HyperAck: st.builds(HyperAck, req_id=ids, optimizer=st.dictionaries(
        st.text(max_size=8), scalars, max_size=4)),
    Heartbeat: st.builds(Heartbeat, req_id=ids, report=st.none() | reports),
}


def test_every_message_kind_has_a_sample():
    assert set(SAMPLES) == set(REGISTRY.values())


@pytest.mark.parametrize("cls", list(SAMPLES), ids=lambda c: c.__name__)
@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip(cls, data):
    msg = data.draw(SAMPLES[cls])
    frames = [b"\x01" * 16] * cls.FRAMES[0]
    wire = codec.encode(msg, frames)
    assert wire[0] == bytes([cls.KIND])
    back, tensor_frames = codec.decode(wire)
    assert back == msg
    assert [bytes(f) for f in tensor_frames] == frames


def test_kinds_are_unique_bytes():
    assert all(0 < k < 256 for k in REGISTRY)
    assert len({c.__name__ for c in REGISTRY.values()}) == len(REGISTRY)


def body(**fields):
    return msgpack.packb(fields)


FETCH = dict(req_id=1, layer=0, min_version=0)


@pytest.mark.parametrize("frames, field", [
    ([], "frames"),
    ([b"\x06"], "frames"),
    ([b"", body(**FETCH)], "kind"),
    ([b"\x06\x06", body(**FETCH)], "kind"),
    ([b"\xff", body(**FETCH)], "kind"),
    ([b"\x06", b"\xc1garbage"], "body"),
    ([b"\x06", msgpack.packb([1, 2, 3])], "body"),
    ([b"\x06", body(req_id=1, layer=0)], "min_version"),
    ([b"\x06", body(**FETCH, extra=1)], "extra"),
    ([b"\x06", body(req_id=1, layer="0", min_version=0)], "layer"),
    ([b"\x06", body(req_id=1, layer=True, min_version=0)], "layer"),
    ([b"\x06", body(req_id=1, layer=-1, min_version=0)], "layer"),
    ([b"\x06", body(**FETCH, which="gradients")], "which"),
    ([b"\x06", body(req_id=-5, layer=0, min_version=0)], "req_id"),
    ([b"\x06", body(**FETCH), b"unexpected tensor"], "frames"),
    ([b"\x05", body(req_id=1, layer=0)], "frames"),  # InitLayer needs its tensor frame
    ([b"\x05", body(req_id=1, layer=0, frozen_dtype="int8"), b"\0" * 4], "frozen_dtype"),
    ([b"\x01", body(req_id=1, protocol_version=1, rank=3, world_size=2, manifest_hash="")],
     "rank"),
    ([b"\x01", body(req_id=1, protocol_version=1, rank=0, world_size=1, manifest_hash="",
                    manifest={"layers": [], "meta": {}})], "manifest"),
    ([b"\x01", body(req_id=1, protocol_version=1, rank=0, world_size=1, manifest_hash="",
                    manifest={"layers": [{"name": "a", "kind": "k", "tensors": [
                        {"name": "w", "shape": [0]}]}], "meta": {}})],
     "manifest.layers[0].tensors[0]"),
    ([b"\x03", body(req_id=1, code="whatever", message="")], "code"),
    ([b"\x01", body(req_id=1, protocol_version=1, rank=0, world_size=1, manifest_hash="",
                    host="box\n2026-11-29 eps-server INFO forged")], "host"),  # (logged)
])
def test_malformed_is_rejected_with_field(frames, field):
    with pytest.raises(codec.DecodeError) as e:
        codec.decode(frames)
    assert e.value.field == field, (e.value.field, str(e.value))


def test_a_peers_unknown_field_name_is_echoed_short():
    """A 1 MiB unknown key went whole into the Error (2 MiB, over the reply limit clients
    decode) and into every log line of the server: 20 MiB of log in 12 s."""
    name = "x" * (1 << 20)
    with pytest.raises(codec.DecodeError) as e:
        codec.decode([b"\x01", body(req_id=1, protocol_version=1, manifest_hash="",
                                    **{name: 1})])
    assert len(str(e.value)) < 200 and len(e.value.field) < 100, str(e.value)[:300]
    assert "(1048576 characters)" in e.value.field


@settings(max_examples=300)
@given(st.lists(st.binary(max_size=64), max_size=5))
def test_random_frames_only_raise_decode_error(frames):
    try:
        codec.decode(frames)
    except codec.DecodeError:
        pass


leaves = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
          | st.text(max_size=5) | st.binary(max_size=5))
values = st.recursive(leaves, lambda c: st.lists(c, max_size=3)
                      | st.dictionaries(st.text(max_size=5), c, max_size=3), max_leaves=10)
field_names = st.sampled_from(["req_id", "layer", "step", "rank", "manifest", "min_version",
                               "slot", "dtype", "path", "x"])


@settings(max_examples=300)
@given(kind=st.sampled_from(sorted(REGISTRY)), fields=st.dictionaries(field_names, values))
def test_hostile_bodies_only_raise_decode_error(kind, fields):
    try:
        codec.decode([bytes([kind]), msgpack.packb(fields, use_bin_type=True)])
    except codec.DecodeError:
        pass


def test_encode_checks_frame_count():
    with pytest.raises(ValueError):
        codec.encode(Fetch(req_id=1, layer=0, min_version=0), [b"x"])


def test_an_undecodable_body_keeps_its_req_id():
    """The Error for a body that does not decode still names its req_id (the body is
    unpacked once)."""
    with pytest.raises(codec.DecodeError) as e:
        codec.decode([b"\x06", body(req_id=42, layer="bad")])
    assert e.value.req_id == 42
    with pytest.raises(codec.DecodeError) as e:
        codec.decode([b"\x06", b"\xc1"])
    assert e.value.req_id == 0


def test_a_body_nested_too_deep_says_why():
    from protocol import codec

    deep = b"\x81\xa1a" * 1300 + b"\xc0"  # {"a": {"a": ... None}}, 1300 deep (< 4 KiB)
    with pytest.raises(codec.DecodeError) as e:
        codec.decode([b"\x06", deep])
    assert not e.value.args[0].endswith(": "), e.value.args[0]


def test_a_manifest_sent_again_is_decoded_once():
    """A flood of Hellos with one large manifest costs one decode (and one hash): the next
    ones get the manifest decoded for the first, by the sha256 of its bytes; a refused one is
    refused again, each time with its own req_id."""
    manifest = Manifest(layers=tuple(LayerSpec(name=f"l{i}", kind="k", tensors=(
        TensorSpec(name="w", shape=(4, i + 1)),)) for i in range(50)), meta={"m": 1})

    def hello(req_id: int, m, **kw) -> list:
        return codec.encode(Hello(req_id=req_id, protocol_version=5, manifest_hash=m.hash(),
                                  manifest=m, **kw))

    first, _ = codec.decode(hello(1, manifest))
    again, _ = codec.decode(hello(2, manifest, pid=7, host="other"))
    assert again.manifest is first.manifest and again.manifest == manifest
    assert (again.req_id, again.pid, again.host) == (2, 7, "other")
    assert again.manifest.hash() is first.manifest.hash()
    other = Manifest(layers=manifest.layers[:-1], meta=manifest.meta)
    third, _ = codec.decode(hello(3, other))
    assert third.manifest == other and third.manifest is not first.manifest
    assert codec.decode(hello(4, manifest))[0].manifest is first.manifest
    bad = msgpack.unpackb(hello(0, manifest)[1])
    bad["manifest"]["layers"][3]["tensors"][0]["shape"] = [0]
    for req_id in (5, 6):
        with pytest.raises(codec.DecodeError) as e:
            codec.decode([b"\x01", msgpack.packb({**bad, "req_id": req_id})])
        assert e.value.field == "manifest.layers[3].tensors[0]" and e.value.req_id == req_id


def test_the_req_id_of_a_message_left_unread():
    """A request refused unread (busy) is answered with the req_id its body starts with."""
    assert codec.request_id(codec.encode(Status(req_id=2**62))) == 2**62
    assert codec.request_id([b"\x06", body(req_id=9, layer=0)]) == 9
    for frames in ([], [b"\x06"], [b"\x06", b""], [b"\x06", b"\xc1"], [b"\x06", body(layer=0)],
                   [b"\x06", body(req_id=-1)], [b"\x06", body(req_id="1")],
                   [b"\x06", msgpack.packb({"x" * 100: 1, "req_id": 3})],
                   [b"\x06", msgpack.packb([1, 2])]):
        assert codec.request_id(frames) == 0, frames


def test_a_manifest_difference_names_what_differs():
    """A LoRA checkpoint loaded without the LoRA options said "'embed_tokens.weight' (41, 32)
    vs server 'embed_tokens.weight' (41, 32)": the difference was that one is frozen."""
    from protocol.tensors import LayerSpec, Manifest, TensorSpec, manifest_difference

    def manifest(group="decay", kind="k", extra=()):
        return Manifest(layers=(LayerSpec(name="pre", kind=kind, tensors=(
            TensorSpec(name="emb.weight", shape=(41, 32), group=group), *extra)),))

    assert manifest_difference(manifest(), manifest()) == ""
    said = manifest_difference(manifest("frozen"), manifest())
    assert said.startswith("layer 'pre' tensor 'emb.weight' (41, 32) vs server 'emb.weight' "
                           "(41, 32) frozen (--freeze or the LoRA options differ"), said
    lora = (TensorSpec(name="lora_A", shape=(4, 32)),)
    assert manifest_difference(manifest(), manifest(extra=lora)) == (
        "layer 'pre': tensor 'lora_A' is not in the server's model (2 tensors vs server 1)")
    assert manifest_difference(manifest(extra=lora), manifest()) == (
        "layer 'pre': tensor 'lora_A' is not in this model (1 tensors vs server 2)")
    assert manifest_difference(manifest(), manifest(kind="k2")) == (
        "layer 'pre' is a 'k2' vs server 'k'")
