"""Hostile input, fixed at the root: each finding of the live-server fuzz and load test as a
test that failed before its fix."""

from __future__ import annotations

import errno
import os
import stat
import time
import tracemalloc

import msgpack
import pytest
import torch

from protocol import codec
from protocol.messages import (
    ANY_RANK,
    PROTOCOL_VERSION,
    Ack,
    Error,
    Fetch,
    Hello,
    LayerReady,
    SetHyper,
    Status,
    StatusReply,
)
from protocol.tensors import LayerSpec, Manifest, TensorSpec
from worker.eps_client import EpsClient, EpsDisconnected

from .test_core import error, grad_of
from .test_server import bootstrap, raw_socket


def test_a_body_over_its_kinds_limit_is_refused_unread():
    """Before: one 63 MiB body of nested empty arrays drove the server to 9.7 GB. A Fetch
    needs well under 1 KiB: a larger body is refused before it is unpacked."""
    nested = msgpack.packb([[] for _ in range(1 << 20)])  # 1 MiB of empty arrays
    with pytest.raises(codec.DecodeError, match="exceeds its limit of 4096"):
        codec.decode([bytes((Fetch.KIND,)), nested])
    big = msgpack.packb({"req_id": 1, "changes": {f"k{i}": i for i in range(1 << 20)}})
    with pytest.raises(codec.DecodeError, match="exceeds its limit"):  # before: 7.9 s
        codec.decode([bytes((SetHyper.KIND,)), big])


def test_a_body_that_decodes_to_too_many_objects_is_refused_with_little_memory():
    """A Hello may be large (a manifest) but not decode to millions of objects: 3 MiB of empty
    arrays stop at the object cap, using a few times the body's size."""
    bomb = msgpack.packb({"req_id": 3, "protocol_version": 2,
                          "x": [[[]] * 700_000 for _ in range(4)]})
    assert len(bomb) < Hello.BODY_LIMIT
    tracemalloc.start()
    try:
        with pytest.raises(codec.DecodeError, match="more than 262144 arrays and maps") as e:
            codec.decode([bytes((Hello.KIND,)), bomb])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * len(bomb), peak
    assert e.value.req_id == 3  # still answerable


def test_a_manifest_bomb_is_refused():
    """Before: a 48 MB Hello with a 1M-layer manifest held the loop 35 s at 2 GB."""
    layers = [{"name": f"l{i}", "kind": "k", "tensors": [{"name": "w", "shape": [1]}]}
              for i in range(200_000)]
    body = msgpack.packb({"req_id": 1, "protocol_version": 2, "rank": 0, "world_size": 1,
                          "manifest_hash": "x", "manifest": {"layers": layers}})
    with pytest.raises(codec.DecodeError):
        codec.decode([bytes((Hello.KIND,)), body])


def test_waiting_requests_per_connection_are_bounded(make):
    """Before: 100,000 waiting Fetches from one peer added 245 MB and delayed everyone by 5 s.
    Now a connection has at most --peer-requests waiting; the rest are refused as busy (not
    stored), the others are served as before, and a Bye releases what waited."""
    h = make(2, peer_requests=16)
    h.bootstrap()
    for i in range(40):
        h.send(1, Fetch(req_id=1000 + i, layer=i % 3, min_version=1))
    replies = [h.take(1, 1000 + i) for i in range(40)]
    assert sum(r is None for r in replies) == 16  # waiting
    assert all(error(r).code == "busy" for r in replies if r is not None)
    assert h.core.stats.busy_refusals == 24
    h.send(0, Fetch(req_id=7, layer=0, min_version=0))
    assert isinstance(h.take(0, 7).msg, LayerReady)  # another rank is served at once
    h.push(0, 0, 2, grad_of(2, 1.0), 8)
    h.poll()
    assert h.take(0, 8) is None  # held (unanswered) until rank 1's part of layer 2 is in
    from protocol.messages import Bye

    h.send(1, Bye(req_id=9, rank=1, done=False))
    gone = [h.take(1, 1000 + i) for i in range(40)]
    assert sum(r is not None and error(r).code == "bad_request" for r in gone) == 16
    assert h.peer(1) not in h.core.waiting._by_peer  # nothing is kept for the connection
    assert h.core.waiting._by_peer == {h.peer(0): {8}}  # rank 0's push still waits


def test_a_req_id_still_waiting_is_not_taken_again(make):
    """Before: the bound counted distinct req_ids, so 300,000 waiting Fetches all numbered 7
    were stored (the EPS grew 35 MiB per 100,000). Now a req_id still waiting on its
    connection is refused; once answered it may be used again."""
    h = make(2, peer_requests=16)
    h.bootstrap()
    h.send(1, Fetch(req_id=7, layer=0, min_version=1))
    for _ in range(100):
        h.send(1, Fetch(req_id=7, layer=1, min_version=1))
        refused = error(h.take(1, 7))
        assert refused.code == "bad_request" and refused.field == "req_id", refused
    assert h.take(1, 7) is None  # the first still waits, alone
    assert [w.request.layer for w in h.core.data.board._waiters if w.peer == h.peer(1)] == [0]
    h.send(1, Status(req_id=7))  # (its reply answered 7, and the next Fetch 7 was stored)
    assert error(h.take(1, 7)).field == "req_id"
    for rank in (0, 1):
        h.push(rank, 0, 0, grad_of(0, 1.0), 20 + rank)
    h.poll()
    assert isinstance(h.take(1, 7).msg, LayerReady)  # answered: 7 is free again
    h.send(1, Fetch(req_id=7, layer=0, min_version=1))
    assert isinstance(h.take(1, 7).msg, LayerReady)


def test_copies_of_the_master_made_for_a_peer_are_bounded(make):
    """A layer's master with frozen tensors under bf16 compute is assembled into a new frame per
    Fetch: 500 unread made the EPS grow 2 GB. At most 8 are held for a peer; more get busy
    until ZeroMQ lets them go (here: until the test drops the replies)."""
    import gc

    from .test_core import FROZEN

    h = make(1, manifest=FROZEN, precision="bf16")
    h.bootstrap()
    for i in range(12):
        h.send(0, Fetch(req_id=100 + i, layer=1, min_version=0, which="master"))
    replies = [h.take(0, 100 + i) for i in range(12)]
    assert all(isinstance(r.msg, LayerReady) for r in replies[:8])
    assert {error(r).code for r in replies[8:]} == {"busy"}
    h.send(0, Fetch(req_id=200, layer=1, min_version=0))  # the served copy: no copy made
    assert isinstance(h.take(0, 200).msg, LayerReady)
    del replies
    gc.collect()
    h.send(0, Fetch(req_id=201, layer=1, min_version=0, which="master"))
    assert isinstance(h.take(0, 201).msg, LayerReady)


def test_finite_gradients_whose_sum_overflows_are_refused(make):
    """Before: two finite gradients of 3e38 summed to inf and layer 2 became -inf silently."""
    h = make(2)
    h.bootstrap()
    h.push(0, 0, 2, grad_of(2, 3e38), 10)
    h.push(1, 0, 2, grad_of(2, 3e38), 11)
    h.poll()
    for rank, req in ((0, 10), (1, 11)):  # both parts are answered with the reason
        e = error(h.take(rank, req))
        assert "is not finite" in e.message and "left as it was" in e.message
    assert h.core.store.versions[2] == 0 and h.core.broken
    assert torch.equal(h.core.store.master(2), torch.ones(h.core.store.plan(2).numel))
    # Stopped updating, still watched: l2l-ctl status's observer Hello, then its Status.
    assert isinstance(h.hello(0, req_id=40, peer=b"ctl", role="observer"), Ack)
    h.send(0, Status(req_id=41), peer=b"ctl")
    assert "is not finite" in h.take(0, 41, peer=b"ctl").msg.stats["broken"]
    h.send(0, Fetch(req_id=42, layer=0, min_version=1))  # a worker's requests: refused
    assert "stopped updating" in error(h.take(0, 42)).message


def test_a_full_shared_memory_is_a_resource_error(make, monkeypatch):
    """An environment failure is a clear error, never "internal"."""
    h = make(1)
    h.bootstrap()

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    reply = h.hello(0, req_id=30, transport="shm")
    assert reply.code == "resource" and "cannot create gradient slots" in reply.message


def test_region_names_cannot_be_taken_first(cluster):
    """Before: another user could create l2l-<run>-grads-r1-float32 first and make rank 1's
    Hello fail with "internal: File exists". Every region name now ends with a random part."""
    cluster.start_server(1)  # regions are made at the first Hello: squat in between
    squat = f"/dev/shm/l2l-{cluster.run_id}-grads-r0-float32"
    with open(squat, "w"):
        pass
    try:
        c = EpsClient(cluster.endpoint, timeout=20)
        try:
            welcome = bootstrap(c, "shm")
            assert welcome.grads.name.startswith(f"l2l-{cluster.run_id}-grads-r0-float32-")
        finally:
            c.close()
    finally:
        if os.path.exists(squat):
            os.unlink(squat)


def test_replies_a_peer_does_not_read_are_counted_not_dropped_silently(server):
    """Before: replies past the socket's high-water mark were dropped without a trace."""
    flood = raw_socket(server.endpoint)
    for i in range(5000):
        flood.send_multipart(codec.encode(Status(req_id=i + 1)))
    c = EpsClient(server.endpoint, timeout=20)
    try:
        deadline = time.monotonic() + 30
        while c.status().stats["replies_dropped"] == 0:
            assert time.monotonic() < deadline, "no reply was reported dropped"
            time.sleep(0.2)
    finally:
        c.close()
        flood.close()


def test_clients_refuse_an_ipc_directory_others_can_enter(tmp_path):
    """Before: a worker connected into a 0777 directory and sent its Hello to whoever
    listened there."""
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    assert stat.S_IMODE(os.stat(open_dir).st_mode) == 0o777
    with pytest.raises(ValueError, match="must be owned by this user with mode 0700"):
        EpsClient(f"ipc://{open_dir}/eps.sock")



def test_a_client_started_before_its_ipc_directory_checks_it_once_it_is_made(tmp_path):
    """A worker started before its EPS found no directory to check and let ZeroMQ connect on
    its own later: whoever made the directory first (another user, in a shared /tmp) got its
    Hello and manifest. It connects only once the directory is there and passes."""
    import zmq

    later = tmp_path / "later"
    c = EpsClient(f"ipc://{later}/eps.sock", timeout=20)
    try:
        fut = c.request(Status)
        time.sleep(0.3)
        later.mkdir()
        os.chmod(later, 0o777)  # made by someone else, open to all
        ctx = zmq.Context()
        listener = ctx.socket(zmq.ROUTER)
        listener.bind(f"ipc://{later}/eps.sock")
        try:
            with pytest.raises(EpsDisconnected, match="must be owned by this user with mode "
                               "0700"):
                c.wait(fut, timeout=10)
            assert listener.poll(500) == 0  # nothing reached it
        finally:
            listener.close(0)
            ctx.term()
    finally:
        c.close()


def large_hello(req_id: int, tag: str, layers: int = 1000) -> bytes:
    """The body of a Hello whose manifest (not the server's) takes ~1.3 MB: 16 tensors per
    layer, 1000 layers."""
    manifest = Manifest(layers=tuple(LayerSpec(name=f"{tag}.{i}", kind="block", tensors=tuple(
        TensorSpec(name=f"blocks.{i}.mlp.proj_{j}.weight", shape=(128, 128)) for j in range(16)))
        for i in range(layers)))
    return codec.encode(Hello(req_id=req_id, protocol_version=PROTOCOL_VERSION, rank=ANY_RANK,
                              manifest_hash="sha256:0", manifest=manifest))[1]


def answers(sock, n: int) -> list:
    return [codec.decode(sock.recv_multipart())[0] for _ in range(n)]


def arrived(sock, into: list) -> list:
    """``into`` with the replies ``sock`` has now."""
    while sock.poll(0):
        into += answers(sock, 1)
    return into


def test_a_flood_of_large_hellos_does_not_hold_the_loop(server):
    """Before: the loop read nothing while a large body was decoded on its thread: a Hello with
    a 1.3 MB manifest (~0.5 s to decode) held every other peer for that long, and eight of
    them made a training step take 4.0 s instead of 0.28 s. Now the other peers are served
    meanwhile (the decoding peer's own requests stay in order), the same manifest is decoded
    once, a peer's large bodies are paced and its backlog is bounded (busy). The job's step
    time during such a flood: python -m bench flood."""
    c = EpsClient(server.endpoint, timeout=60)
    watch = EpsClient(server.endpoint, timeout=60)
    flood = raw_socket(server.endpoint)
    try:
        c.start_heartbeats(bootstrap(c).heartbeat_interval)
        watch.observe()

        def round_trip() -> float:
            t0 = time.perf_counter()
            assert isinstance(watch.status(), StatusReply)
            return time.perf_counter() - t0

        quiet = sorted(round_trip() for _ in range(20))[10]
        same, other = large_hello(0, "a"), large_hello(0, "b")
        assert len(same) > 1_200_000
        bodies = [msgpack.packb({**msgpack.unpackb(same if i < 6 else other), "req_id": i + 1})
                  for i in range(8)]  # 6 of one manifest, 2 of another, then a small request
        for body in bodies:
            flood.send_multipart([bytes((Hello.KIND,)), body])
        flood.send_multipart(codec.encode(Status(req_id=99)))
        loud, replies = [round_trip()], []  # sent after the eight: answered before them
        assert arrived(flood, replies) == [], "the Status waited for a Hello sent before it"
        while len(arrived(flood, replies)) < 9:  # meanwhile the others are served as ever
            loud.append(round_trip())
            assert isinstance(c.wait(c.fetch(0, 0))[0], LayerReady)
            time.sleep(0.02)
        # One peer's requests are taken in order.
        assert [r.req_id for r in replies] == [*range(1, 9), 99]
        assert {r.code for r in replies[:8]} == {"manifest_mismatch"}
        assert isinstance(replies[8], StatusReply)
        bound = max(10 * quiet, 0.25)
        assert sorted(loud)[len(loud) // 2] < bound, (loud, quiet)
        # A peer's backlog behind a large body is bounded: the rest is refused, unread.
        flood.send_multipart([bytes((Hello.KIND,)), large_hello(200, "c")])
        for i in range(40):
            flood.send_multipart(codec.encode(Status(req_id=201 + i)))
        replies = answers(flood, 41)
        busy = [r.req_id for r in replies if isinstance(r, Error) and r.code == "busy"]
        assert len(busy) >= 20 and sorted(busy) == busy and busy[-1] == 240, busy
        served = [r.req_id for r in replies if r.req_id not in busy]
        assert served == [200, *range(201, 201 + len(served) - 1)]
        assert watch.status().stats["busy_refusals"] == len(busy)
    finally:
        flood.close()
        watch.close()
        c.close()


@pytest.fixture
def server(cluster):
    cluster.start_server(1)
    return cluster

