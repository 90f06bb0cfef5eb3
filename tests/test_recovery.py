"""The job outlives its workers and its EPS (real processes, real signals): with
``--max-restarts 1`` a worker killed at any point of a step, or hung, is replaced and the final
weights are bitwise those of a run without failures; a killed EPS restarts the job from its last
checkpoint. Without restarts, a hung worker fails the job cleanly.

Workers kill (or stop) themselves at a chosen point with ``--fault`` (worker/faults.py). The
model is tests.helpers.SMALL: layers 0 (embeddings), 1-2 (blocks), 3 (head), dropout on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from protocol.shm import list_regions

from .helpers import ENV, SMALL
from .test_launch import LAUNCH, assert_nothing_left, launch, processes_with

STEPS = 4
TIMEOUT = "2"  # --heartbeat-timeout: a hung worker is declared dead after 2 s of silence
JOB = ["--workers", "2", "--steps", str(STEPS), *SMALL, "--heartbeat-timeout", TIMEOUT]


@pytest.fixture
def reference(failure_free):
    """The failure-free run's final weights, per update mode (tests/conftest.py)."""
    return lambda update: failure_free(*JOB, "--update", update)


def recovered(tmp_path, fault: str, *extra: str) -> tuple[dict, bytes]:
    p, s, endpoint = launch(tmp_path, *JOB, "--max-restarts", "1", "--fault", fault,
                            "--save", str(tmp_path / "m.st"), *extra)
    assert p.returncode == 0, p.stderr
    assert_nothing_left(endpoint, s["run_id"])
    [restart] = s["restarts"]
    restart["run_id"] = s["run_id"]
    print(f"{fault}: {restart}")  # the detection and rejoin times (pytest -s shows them)
    return restart, (tmp_path / "m.st").read_bytes()


@pytest.mark.parametrize("fault,update", [
    ("1:2:B1", "eager"),  # backward: layers 3 and 2 pushed (and maybe updated) already
    pytest.param("1:1:F2", "deferred", marks=pytest.mark.slow),  # forward, nothing pushed yet
    pytest.param("0:2:H3", "eager", marks=pytest.mark.slow),  # the head: nothing pushed
    pytest.param("1:1:B1", "deferred", marks=pytest.mark.slow),
    pytest.param("1:1:E", "eager", marks=pytest.mark.slow),  # between steps: all pushed
])
def test_a_killed_worker_is_replaced_and_the_run_is_exact(tmp_path, reference, fault, update):
    restart, weights = recovered(tmp_path, fault, "--update", update)
    rank, step, point = fault.split(":")
    assert restart["rank"] == int(rank) and restart["cause"] == "was killed by SIGKILL"
    # The EPS saw the process gone (same host): the replacement did not wait out the timeout.
    eps_log = (tmp_path / "runs" / restart["run_id"] / "eps.log").read_text()
    assert f"rank {rank} (pid " in eps_log and "declared dead: its process" in eps_log, eps_log
    assert "nothing heard" not in eps_log, eps_log
    # Layers whose push had reached the EPS when it died: pushes leave from the I/O thread, so
    # at B1 layers 3 and 2 may or may not be out (tests/test_recovery_core.py pins each case).
    pushed = {"B1": (0, 1, 2), "F2": (0,), "H3": (0,), "E": (0,)}[point]
    resumed = int(step) + 1 if point == "E" else int(step)
    assert restart["resumed_step"] == resumed and restart["layers_already_pushed"] in pushed
    assert weights == reference(update), "the recovered run's weights differ"


@pytest.mark.parametrize("point", ["P", "E"])
def test_a_worker_killed_before_it_reports_leaves_no_hole_in_the_results(tmp_path, point):
    """Killed once every push of step 1 was in but before reporting it (P), the step had no
    row (the summary said 3 steps of 4); killed before its evaluation after step 1 (E), its
    replacement (resuming at step 2) did not evaluate, and that evaluation was lost."""
    import numpy as np

    rng = np.random.default_rng(0)
    for name, n in (("train.bin", 20_000), ("eval.bin", 2_000)):
        rng.integers(0, 64, n).astype(np.uint16).tofile(tmp_path / name)
    p, s, _ = launch(tmp_path, *JOB, "--model", "gpt", "--data", "train.bin", "--data-format",
                     "tokens", "--eval-data", "eval.bin", "--eval-every", "2",
                     "--max-restarts", "1", "--fault", f"1:1:{point}")
    assert p.returncode == 0, p.stderr
    [restart] = s["restarts"]
    assert restart["resumed_step"] == 2 and restart["layers_already_pushed"] == 0, restart
    assert s["steps"] == STEPS and len(s["losses"]) == STEPS, s
    assert [e["step"] for e in s["eval"]] == [0, 2, 4], s["eval"]


def test_a_hung_worker_is_declared_dead_killed_and_replaced(tmp_path, reference):
    restart, weights = recovered(tmp_path, "1:2:B2:stop")
    assert restart["cause"].startswith("hung: declared dead after")
    # Declared dead once silent for the timeout (the EPS looks 4 times per timeout).
    assert float(TIMEOUT) <= restart["detected_after"] < float(TIMEOUT) * 2
    assert restart["layers_already_pushed"] in (0, 1)  # layer 3's push may be out
    assert weights == reference("eager")


@pytest.mark.slow  # the default suite has a killed worker failing the job (test_launch.py)
def test_without_restarts_a_hung_worker_fails_the_job_cleanly(tmp_path):
    p, s, endpoint = launch(tmp_path, *JOB, "--fault", "1:1:F1:stop")
    assert p.returncode == 1
    assert "w1" in s["failure"] and "declared dead by the EPS" in s["failure"], s["failure"]
    assert_nothing_left(endpoint, s["run_id"])


def test_a_killed_eps_restarts_the_job_from_its_last_checkpoint(tmp_path, failure_free):
    """K = 2: checkpoints every 2 steps; the EPS is killed once a checkpoint exists, and at
    most K completed steps are trained again."""
    ck, summary, endpoint = tmp_path / "ck", tmp_path / "s.json", f"ipc://{tmp_path}/eps.sock"
    steps = 8
    p = subprocess.Popen([*LAUNCH, "--endpoint", endpoint, "--summary-json", str(summary),
                          "--workers", "2", "--steps", str(steps), *SMALL, "--max-restarts", "1",
                          "--server-save", str(ck), "--checkpoint-every", "2",
                          "--save", str(tmp_path / "m.st")],
                         env=ENV, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (ck / "latest").exists():
            assert time.monotonic() < deadline and p.poll() is None, p.communicate()
            time.sleep(0.05)
        [eps] = [pid for pid in processes_with(endpoint) if b"eps_server" in
                 open(f"/proc/{pid}/cmdline", "rb").read()]
        os.kill(eps, signal.SIGKILL)
        out, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, err
    s = json.loads(summary.read_text())
    [restart] = s["restarts"]
    restart["run_id"] = s["run_id"]
    print(restart)
    assert restart["rank"] is None and "eps-server was killed by SIGKILL" in restart["cause"]
    assert restart["checkpoint_step"] in range(2, steps, 2)
    assert 0 <= restart["steps_replayed"] <= 2
    assert s["steps"] == steps
    # the job of tests/test_disk_full.py's reference too: run once for both
    reference = failure_free("--workers", "2", "--steps", str(steps), *SMALL)
    assert (tmp_path / "m.st").read_bytes() == reference
    assert not list_regions(f"l2l-{s['run_id']}-")


@pytest.mark.slow
def test_a_killed_eps_never_restarts_from_another_runs_checkpoint(tmp_path):
    """--server-save already holds an earlier run's checkpoint; the EPS dies before this run
    wrote one: the job restarts from its own start, not from the stranger's weights."""
    ck = tmp_path / "ck"
    p, s, _ = launch(tmp_path, "--workers", "1", "--steps", "3", *SMALL, "--server-save", str(ck))
    assert p.returncode == 0 and (ck / "latest").exists(), p.stderr
    endpoint, summary = f"ipc://{tmp_path}/b.sock", tmp_path / "b.json"
    job = subprocess.Popen([*LAUNCH, "--endpoint", endpoint, "--summary-json", str(summary),
                            "--workers", "1", "--steps", "8", *SMALL, "--max-restarts", "1",
                            "--server-save", str(ck), "--log-every", "1"],
                           env=ENV, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        for line in job.stdout:  # once this run has trained a step (no checkpoint of its own)
            if line.startswith("step ") and "/8" in line:
                break
        [eps] = [pid for pid in processes_with(endpoint) if b"eps_server" in
                 open(f"/proc/{pid}/cmdline", "rb").read()]
        os.kill(eps, signal.SIGKILL)
        job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 0
    [restart] = json.loads(summary.read_text())["restarts"]
    assert restart["checkpoint_step"] is None, restart  # not the earlier run's step 3


def kill_eps_when(tmp_path, bound: bool, *extra: str) -> subprocess.CompletedProcess:
    """Run JOB under --max-restarts 2 and SIGKILL its first EPS as soon as its process exists
    (importing, long before it binds) or, with ``bound``, once its socket exists (the first
    worker is bootstrapping it or about to); returns the finished launcher."""
    endpoint, summary = f"ipc://{tmp_path}/eps.sock", tmp_path / "summary.json"
    p = subprocess.Popen([*LAUNCH, "--endpoint", endpoint, "--summary-json", str(summary),
                          *JOB, "--max-restarts", "2", "--save", str(tmp_path / "m.st"), *extra],
                         env=ENV, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline and p.poll() is None, p.communicate()
            eps = [pid for pid in processes_with(endpoint) if b"eps_server" in
                   open(f"/proc/{pid}/cmdline", "rb").read()]
            if eps and (not bound or (tmp_path / "eps.sock").exists()):
                os.kill(eps[0], signal.SIGKILL)
                break
            time.sleep(0.005)
        out, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


@pytest.mark.parametrize("bound", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_an_eps_killed_as_it_starts_is_restarted_and_the_run_is_exact(tmp_path, reference,
                                                                      bound):
    p = kill_eps_when(tmp_path, bound)
    assert p.returncode == 0, p.stderr
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["ok"] and s["failure"] is None and s["steps"] == STEPS, s
    [restart] = s["restarts"]
    assert restart["rank"] is None and "eps-server was killed by SIGKILL" in restart["cause"]
    assert restart["checkpoint_step"] is None and restart["steps_replayed"] == 0, restart
    assert "restarting the job from where it began" in p.stderr
    assert_nothing_left(f"ipc://{tmp_path}/eps.sock", s["run_id"])
    assert (tmp_path / "m.st").read_bytes() == reference("eager")


def test_an_eps_that_refuses_to_start_fails_the_job_at_once_despite_restarts(tmp_path):
    """Its own error (here a checkpoint to load that is not there) would come back at every
    restart: the job fails at once, saying why, and no restart is spent."""
    t0 = time.monotonic()
    p, s, endpoint = launch(tmp_path, *JOB, "--max-restarts", "2",
                            "--load", str(tmp_path / "nothing-here"))
    assert p.returncode == 1 and not s["ok"], p.stderr
    assert s["restarts"] == [] and "before it was ready" in s["failure"], s["failure"]
    assert "nothing-here" in p.stderr, p.stderr  # the EPS's own reason reaches the console
    assert time.monotonic() - t0 < 60
    assert_nothing_left(endpoint, s["run_id"])
