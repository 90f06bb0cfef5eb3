"""CURVE on tcp (real processes, real sockets): an authorised worker trains; a client with an
unknown key, with no key or with a wrong server key is refused at the handshake with a clear
error (not a timeout); a live rank cannot be taken over; a control client evicts nobody; a
non-loopback address needs CURVE unless --insecure is given."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from protocol import curve
from protocol.endpoints import check_bind
from protocol.messages import Bye
from worker.eps_client import EpsClient, EpsDisconnected, EpsError

from .helpers import ENV, ROOT, SMALL, Cluster, free_port
from .test_server import MANIFEST, refused

CTL = [sys.executable, "-m", "launch.ctl"]


def make_keys(d):
    """server, alice and bob (allowed), mallory (not allowed); each NAME.key / NAME.key_secret."""
    subprocess.run([*CTL, "keygen", str(d), "server"], env=ENV, cwd=ROOT, check=True,
                   capture_output=True)
    for name in ("alice", "bob", "mallory"):
        curve.generate(str(d), name)
    (d / "clients").mkdir()
    for name in ("alice", "bob"):
        shutil.copy(d / f"{name}.key", d / "clients")
    return d


@pytest.fixture
def keys(tmp_path):
    return make_keys(tmp_path / "keys")


def start_secure(cluster, keys):
    cluster.endpoint = f"tcp://127.0.0.1:{free_port()}"
    cluster.start_server(1, "--curve-secret-key", str(keys / "server.key_secret"),
                         "--curve-clients", str(keys / "clients"), "--heartbeat-timeout", "2")
    return cluster


@pytest.fixture
def secure(cluster, keys):
    return start_secure(cluster, keys)


@pytest.fixture(scope="module")
def secure_for_refusals(tmp_path_factory):
    """One CURVE EPS (and its keys) for the handshakes that are refused: each leaves it as it
    was, and each test checks that it still serves."""
    tmp = tmp_path_factory.mktemp("curve")
    c = Cluster(tmp)
    try:
        keys = make_keys(tmp / "keys")
        yield start_secure(c, keys), keys
    finally:
        c.close()


def client(cluster, keys, name: str | None, server: str = "server") -> EpsClient:
    k = curve.client_keys(str(keys / f"{server}.key"), str(keys / f"{name}.key_secret")) \
        if name else None
    return EpsClient(cluster.endpoint, timeout=20, curve=k)


def test_keygen_writes_a_pair_whose_secret_only_its_owner_reads(keys):
    public, secret = curve.load_secret(str(keys / "alice.key_secret"))
    assert curve.load_public(str(keys / "alice.key")) == public and len(secret) == 40
    assert (keys / "alice.key_secret").stat().st_mode & 0o777 == 0o600
    (keys / "alice.key_secret").chmod(0o644)
    with pytest.raises(ValueError, match="owner only"):
        curve.load_secret(str(keys / "alice.key_secret"))
    with pytest.raises(ValueError, match="public key only"):
        curve.load_secret(str(keys / "alice.key"))



def test_keygen_writes_the_secret_owner_only_from_the_start_and_replaces_no_key(tmp_path,
                                                                                monkeypatch):
    """The library writes a key with the process's umask (0644 here, then chmod: a window in
    which others could open it); a second keygen of a name replaced the pair in use."""
    import zmq.auth

    seen = {}
    real = zmq.auth.create_certificates

    def spy(directory, name):
        out = real(directory, name)
        seen["mode"] = os.stat(out[1]).st_mode & 0o777  # as written, before anything after
        return out

    monkeypatch.setattr(zmq.auth, "create_certificates", spy)
    public, secret = curve.generate(str(tmp_path), "k")
    assert seen["mode"] == 0o600 and os.stat(public).st_mode & 0o777 == 0o644
    before = open(secret).read()
    with pytest.raises(FileExistsError, match="k.key exists: keys are not replaced"):
        curve.generate(str(tmp_path), "k")
    assert open(secret).read() == before
    p = subprocess.run([*CTL, "keygen", str(tmp_path), "k"], env=ENV, cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "keys are not replaced" in p.stderr and not p.stdout


@pytest.mark.parametrize("name,server,why", [
    ("mallory", "server", "not among the EPS's allowed clients"),
    (None, "server", "the EPS requires CURVE"),
    ("alice", "mallory", "wrong server key"),
])
def test_a_client_without_an_allowed_key_is_refused_at_the_handshake(secure_for_refusals,
                                                                      name, server, why):
    secure, keys = secure_for_refusals
    c = client(secure, keys, name, server)
    t = time.monotonic()
    try:
        with pytest.raises(EpsDisconnected, match=why):
            c.status()
        assert time.monotonic() - t < 10  # told, not left to time out (20 s)
    finally:
        c.close()
    assert secure.server.poll() is None


def test_an_authorised_worker_trains_over_tcp_and_a_control_client_evicts_nobody(secure, keys):
    w = secure.worker(0, 1, *SMALL, "--steps", "1000000", "--curve-server-key",
                      str(keys / "server.key"), "--curve-key", str(keys / "alice.key_secret"))
    ctl = [*CTL, "--endpoint", secure.endpoint, "--curve-server-key", str(keys / "server.key"),
           "--curve-key", str(keys / "bob.key_secret")]
    seen = []
    deadline = time.monotonic() + 120
    while w.poll() is None and time.monotonic() < deadline:
        p = subprocess.run([*ctl, "status", "--json"], env=ENV, cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        status = json.loads(p.stdout)
        seen.append(status["ranks"])
        if status["step"] >= 2:
            break
        time.sleep(0.2)
    assert [0] in seen  # the worker was registered while l2l-ctl said Hello as an observer
    w.terminate()  # the job is longer than any test: stopped here; a worker says Bye on SIGTERM
    assert secure.wait(w, 60) == 128 + signal.SIGTERM, secure.log(w)
    secure.server.terminate()
    assert secure.wait(secure.server, 60) == 0
    log = secure.log(secure.server)
    assert "declared dead" not in log and "replaces" not in log, log
    assert "observer (pid" not in log, log  # each l2l-ctl said Bye


def test_a_live_rank_is_not_taken_over_but_its_own_key_may_replace_it(secure, keys):
    a, b, a2 = (client(secure, keys, n) for n in ("alice", "bob", "alice"))
    hello = dict(rank=0, world_size=1, manifest=MANIFEST, transport="frames",
                 grad_dtype="float32")
    try:
        welcome = a.hello(**hello)
        a.start_heartbeats(welcome.heartbeat_interval)
        refused(lambda: b.hello(**hello), "rank_taken")  # another key, a live holder
        assert a.status().ranks == (0,)
        a2.hello(**hello)  # the same key from a new connection: a restarted worker
        # The old connection no longer holds the rank (its next heartbeat may tell it first).
        with pytest.raises((EpsError, EpsDisconnected), match="not_registered|no longer knows"):
            a.call(Bye, rank=0, done=True)
    finally:
        for c in (a, b, a2):
            c.close()


def test_non_loopback_tcp_needs_curve_unless_insecure(cluster, keys, tmp_path):
    with pytest.raises(ValueError, match="--curve-secret-key"):
        check_bind("tcp://0.0.0.0:5555")
    assert check_bind("tcp://0.0.0.0:5555", authenticated=True) is None
    assert "anyone who can reach" in check_bind("tcp://0.0.0.0:5555", insecure=True)
    port = free_port()
    p = subprocess.run([sys.executable, "-m", "eps_server", "--endpoint",
                        f"tcp://0.0.0.0:{port}", "--run-id", cluster.run_id], env=ENV,
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "--insecure" in p.stderr, p.stderr
    cluster.endpoint = f"tcp://0.0.0.0:{port}"
    cluster.start_server(1, "--insecure")
    assert "WARNING" in cluster.log(cluster.server)
    c = EpsClient(f"tcp://127.0.0.1:{port}", timeout=20)
    try:
        assert c.status().world_size == 1
    finally:
        c.close()
