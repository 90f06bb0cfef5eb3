"""Shared memory left by a killed eps-server is found and removed: by the next server's start
and by ``l2l-ctl cleanup``; a live server's regions and regions of unknown origin never."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys

import pytest

from protocol.shm import Region, list_regions, unlink_prefix
from worker.eps_client import EpsClient

from .helpers import ENV, ROOT

# Every test here leaves a killed server's regions for a server (or cleanup) to find: one that
# another test starts meanwhile would remove them first.
pytestmark = pytest.mark.exclusive

# A stand-in eps-server holding its run lock and three regions; "die" kills it with SIGKILL
# (nothing of it runs on exit), "live" keeps it running until the test ends.
HOLDER = """
import os, signal, sys, time
from protocol.shm import Region, RunLock
run, mode = sys.argv[1:]
lock = RunLock(run)
regions = [Region.create(f"l2l-{run}-params-{i}-{os.getpid()}", 4096) for i in range(3)]
print("ready", flush=True)
if mode == "die":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(300)
"""


@pytest.fixture
def runs():
    """Make run ids; whatever the test leaves under them is removed."""
    made, procs = [], []

    def holder(mode: str, run: str | None = None) -> str:
        run = run or "o" + secrets.token_hex(4)
        made.append(run)
        p = subprocess.Popen([sys.executable, "-c", HOLDER, run, mode], env=ENV,
                             stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout.readline().strip() == "ready"
        if mode == "die":
            assert p.wait(timeout=30) == -9
        return run

    try:
        yield holder
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for run in made:
            unlink_prefix(f"l2l-{run}-")


def regions_of(run: str) -> list[str]:
    return list_regions(f"l2l-{run}-")


def ctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.ctl", *args], env=ENV, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_the_next_server_removes_a_killed_servers_regions(cluster, runs):
    dead, live = runs("die"), runs("live")
    unknown = Region.create(f"l2l-u{secrets.token_hex(4)}-x", 64)  # no lock file: not judged
    try:
        assert len(regions_of(dead)) == 4  # three regions and the lock file
        cluster.start_server(1)
        assert regions_of(dead) == []
        assert len(regions_of(live)) == 4, "a live server's regions were touched"
        assert list_regions(unknown.name) == [unknown.name]
        assert f"removed 3 shared-memory regions (0.0 MiB) of run {dead}" in \
            cluster.log(cluster.server)
    finally:
        unknown.close()
        unknown.unlink()


def test_a_restarted_run_removes_its_own_leftovers(cluster, runs):
    runs("die", cluster.run_id)  # an earlier server of this very run id, killed
    assert len(regions_of(cluster.run_id)) == 4
    cluster.start_server(1)
    c = EpsClient(cluster.endpoint, timeout=20)
    try:
        assert c.status().run_id == cluster.run_id
    finally:
        c.close()
    assert regions_of(cluster.run_id) == [f"l2l-{cluster.run_id}-lock"]  # the new server's
    assert "removed 3 shared-memory regions left by an earlier server" in \
        cluster.log(cluster.server)


def test_a_run_id_in_use_is_refused(cluster):
    cluster.start_server(1)
    second = cluster.spawn([sys.executable, "-m", "eps_server", "--endpoint",
                            cluster.endpoint.replace("eps.sock", "b.sock"), "--run-id",
                            cluster.run_id], "eps-b")
    assert cluster.wait(second, 60) == 2
    assert f"run id {cluster.run_id!r} is in use" in cluster.log(second)
    c = EpsClient(cluster.endpoint, timeout=20)  # the first one is unharmed
    try:
        assert c.status().run_id == cluster.run_id
    finally:
        c.close()
    assert regions_of(cluster.run_id) == [f"l2l-{cluster.run_id}-lock"]


def test_a_run_id_whose_lock_is_another_users_says_so(monkeypatch):
    """It was a bare "[Errno 13] Permission denied: '/dev/shm/l2l-<run>-lock'"; as root here,
    the other user's file is its open refused."""
    from protocol import shm

    def refused(path, create):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(shm, "_try_lock", refused)
    with pytest.raises(ValueError, match="run id 'x1' is in use by another user's eps-server"):
        shm.RunLock("x1")


def test_l2l_ctl_cleanup(runs):
    dead, live = runs("die"), runs("live")
    listed = ctl("cleanup", "--dry-run")
    assert listed.returncode == 0, listed.stderr
    found = json.loads(listed.stdout)
    assert sorted(found[dead]) == regions_of(dead) and live not in found
    assert len(regions_of(dead)) == 4  # a dry run removes nothing
    done = ctl("cleanup")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[dead] == {"regions": 3, "bytes": 3 * 4096}
    assert regions_of(dead) == [] and len(regions_of(live)) == 4


def test_a_launcher_removes_its_runs_memory_only_when_no_live_server_holds_it(runs):
    """After its EPS exited, a launcher removes the run's regions and lock (a SIGKILLed EPS
    leaves them); but a second launch of a run id in use, refused, must not take the running
    job's memory (and lock) away: its replacement workers then failed to attach."""
    from protocol.shm import unlink_run

    live = runs("live")
    assert unlink_run(live) == [] and len(regions_of(live)) == 4  # 3 regions and the lock
    dead = runs("die")
    before = regions_of(dead)
    assert len(before) == 4 and sorted(unlink_run(dead)) == sorted(before)
    assert regions_of(dead) == []
