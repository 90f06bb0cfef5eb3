"""A live eps-server under >= 10,000 random and mutated messages (slow): it never crashes, never
answers "internal", answers what it can, and a valid client then trains exactly (bitwise equal
to a server that never saw the fuzz).

The messages come from several connections (some replaced as they go): random frames, valid
messages of every kind, the same with a byte flipped, truncated, a field replaced by a random
value, frames added or dropped, or the kind byte changed. Save is left out (the fuzz would
write checkpoints wherever a random path points). L2L_FUZZ_EXAMPLES sets the volume (batches
of 20 messages; default 500).
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eps_server.config import MUTABLE
from protocol import codec
from protocol.messages import REGISTRY, Save, SetHyper, Status
from worker.eps_client import EpsClient

from .helpers import Cluster
from .test_protocol import SAMPLES, values
from .test_server import LAYOUT, bootstrap, master

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("L2L_FUZZ_EXAMPLES", "500"))
BATCH = 20
SERVER = ("--optimizer", "sgd", "--lr", "0.1", "--weight-decay", "0", "--heartbeat-timeout", "5")
SAVE = bytes([Save.KIND])
STATUS = bytes([Status.KIND])


@st.composite
def valid(draw) -> list[bytes]:
    cls = draw(st.sampled_from([c for c in SAMPLES if c is not Save]))
    msg = draw(SAMPLES[cls])
    lo, hi = cls.FRAMES
    tensors = draw(st.lists(st.binary(max_size=512), min_size=lo, max_size=min(hi, 2)))
    return [bytes(f) for f in codec.encode(msg, tensors)]


@st.composite
def mutated(draw) -> list[bytes]:
    frames = draw(valid())
    how = draw(st.sampled_from(["flip", "truncate", "field", "extra", "drop", "kind"]))
    body = frames[1] if len(frames) > 1 else b""
    if how == "flip" and body:
        i = draw(st.integers(0, len(body) - 1))
        frames[1] = body[:i] + bytes([body[i] ^ draw(st.integers(1, 255))]) + body[i + 1:]
    elif how == "truncate" and body:
        frames[1] = body[:draw(st.integers(0, len(body) - 1))]
    elif how == "field" and body:
        fields = msgpack.unpackb(body)
        key = draw(st.sampled_from(sorted(fields)) | st.text(max_size=8))
        fields[key] = draw(values)
        frames[1] = msgpack.packb(fields, use_bin_type=True)
    elif how == "extra":
        frames.append(draw(st.binary(max_size=256)))
    elif how == "drop":
        frames.pop()
    else:
        frames[0] = bytes([draw(st.sampled_from(sorted(REGISTRY)) | st.integers(0, 255))])
    return frames


raw = st.lists(st.binary(max_size=128), min_size=0, max_size=4)
messages = st.one_of(valid(), mutated(), mutated(), raw)


class Fuzzer:
    """Raw DEALER connections to the EPS; counts what it sends and the replies' codes."""

    def __init__(self, endpoint: str, connections: int = 4):
        self.endpoint = endpoint
        self.ctx = zmq.Context()
        self.socks = [self._connect() for _ in range(connections)]
        self.sent = 0
        self.replies: collections.Counter = collections.Counter()

    def _connect(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.endpoint)
        return s

    def send(self, batch: list[list[bytes]], renew: int) -> None:
        if renew >= 0:  # a peer goes away, another comes
            self.socks[renew % len(self.socks)].close(0)
            self.socks[renew % len(self.socks)] = self._connect()
        for i, frames in enumerate(batch):
            if frames and frames[0] == SAVE:
                frames[0] = STATUS
            if not frames:
                frames = [b""]  # ZeroMQ sends no empty message
            self.socks[i % len(self.socks)].send_multipart(frames)
            self.sent += 1
        self.drain(50)

    def drain(self, idle_ms: int) -> None:
        poller = zmq.Poller()
        for s in self.socks:
            poller.register(s, zmq.POLLIN)
        while ready := poller.poll(idle_ms):
            for s, _ in ready:
                frames = s.recv_multipart()
                try:
                    msg, _ = codec.decode(frames)
                except codec.DecodeError as e:
                    raise AssertionError(f"the EPS sent an undecodable reply: {e}") from None
                self.replies[getattr(msg, "code", type(msg).__name__)] += 1

    def close(self) -> None:
        for s in self.socks:
            s.close(0)
        self.ctx.term()


def train(client: EpsClient, steps: int) -> list[bytes]:
    """Push seeded gradients for every layer of ``steps`` steps; the masters' bytes."""
    gen = torch.Generator().manual_seed(7)
    for step in range(steps):
        for plan in reversed(LAYOUT.layers):
            g = torch.randn(plan.numel, generator=gen)
            client.wait(client.push_grad(step=step, layer=plan.index, rank=0, slot=-1,
                                         dtype="float32", data=g.numpy().data))
    return [master(client, plan.index, steps).numpy().tobytes() for plan in LAYOUT.layers]


def reference(tmp: Path, steps: int) -> list[bytes]:
    tmp.mkdir()
    cluster = Cluster(tmp)
    try:
        cluster.start_server(1, *SERVER)
        c = EpsClient(cluster.endpoint, timeout=20)
        try:
            bootstrap(c)
            return train(c, steps)
        finally:
            c.close()
    finally:
        cluster.close()


def test_the_eps_survives_a_fuzz_and_then_trains_exactly(cluster, tmp_path, capsys):
    cluster.start_server(1, *SERVER)
    client = EpsClient(cluster.endpoint, timeout=20)
    fuzz = Fuzzer(cluster.endpoint)
    try:
        welcome = bootstrap(client)
        client.start_heartbeats(welcome.heartbeat_interval)  # its rank stays taken
        settings_before = client.call(SetHyper, changes={"lr": 0.1}).optimizer

        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(batch=st.lists(messages, min_size=BATCH, max_size=BATCH),
               renew=st.integers(-8, 3))
        def run(batch, renew):
            fuzz.send(batch, renew)
            assert cluster.server.poll() is None, cluster.log(cluster.server)

        run()
        fuzz.drain(500)
        log = cluster.log(cluster.server)
        assert cluster.server.poll() is None, log
        assert fuzz.replies["internal"] == 0 and "Traceback" not in log, log
        assert fuzz.sent >= EXAMPLES * BATCH
        stats = client.status().stats
        with capsys.disabled():
            print(f"\nfuzz: {fuzz.sent} messages, {sum(fuzz.replies.values())} replies "
                  f"{dict(fuzz.replies.most_common())}; EPS peak rss "
                  f"{stats.get('vmhwm_bytes', 0) / 2**20:.0f} MiB")
        # Settings a control peer may change are put back; then training is exact.
        client.call(SetHyper, changes={k: settings_before[k] for k in MUTABLE})
        assert train(client, 3) == reference(tmp_path / "ref", 3)
    finally:
        fuzz.close()
        client.close()
