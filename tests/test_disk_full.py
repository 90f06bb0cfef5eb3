"""A full disk under --server-save, with real processes: the launcher runs in a mount namespace
of its own (``unshare -rm``) where the checkpoint root is a tmpfs that holds one checkpoint of
the model but not two. Skipped, saying why, where user namespaces are not allowed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from eps_server import checkpoint
from protocol.checkpoints import LATEST, resolve

from .helpers import ENV, SMALL
from .test_launch import LAUNCH, assert_nothing_left, processes_with

STEPS = 8
JOB = ["--workers", "2", "--steps", str(STEPS), *SMALL]
TMPFS_KIB = 600  # one checkpoint of this model is ~380 KiB: a second does not fit beside it
# Mount a small tmpfs on $0 in a private mount namespace, run the command, then copy what
# the tmpfs holds out ($0.after) before the namespace (and the tmpfs) goes.
IN_TMPFS = ('mount -t tmpfs -o size={size}k tmpfs "$0" || exit 97; "$@"; rc=$?; '
            'cp -a "$0" "$0.after"; exit $rc')


def unshare_works(tmp_path) -> str:
    """"" if a user can mount a tmpfs in a namespace of its own here, else why not."""
    if shutil.which("unshare") is None:
        return "no unshare(1) here"
    probe = tmp_path / "probe"
    probe.mkdir()
    p = subprocess.run(["unshare", "-rm", "sh", "-c", IN_TMPFS.format(size=64), str(probe),
                        "true"], capture_output=True, text=True, timeout=30)
    return "" if p.returncode == 0 else f"cannot mount a tmpfs in a user namespace: {p.stderr}"


def start(tmp_path, *extra: str) -> tuple[subprocess.Popen, str]:
    why = unshare_works(tmp_path)
    if why:
        pytest.skip(why)
    disk = tmp_path / "disk"
    disk.mkdir()
    endpoint = f"ipc://{tmp_path}/eps.sock"
    cmd = ["unshare", "-rm", "sh", "-c", IN_TMPFS.format(size=TMPFS_KIB), str(disk), *LAUNCH,
           "--endpoint", endpoint, "--summary-json", str(tmp_path / "s.json"), *JOB,
           "--server-save", str(disk / "ck"), "--checkpoint-every", "2",
           "--save", str(tmp_path / "m.st"), *extra]
    p = subprocess.Popen(cmd, env=ENV, cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    return p, endpoint


def finish(p: subprocess.Popen, timeout: float = 240) -> tuple[str, str]:
    try:
        return p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_a_full_disk_is_said_at_once_counted_and_the_job_resumes_from_the_last_good(
        tmp_path, failure_free):
    """Checkpoints every 2 steps: step 2's is written, step 4's finds the disk full. The
    launcher says so at once in one line (with --quiet), no traceback is logged, the partial
    files are gone and step 2 stays the latest. The EPS is then killed: the job restarts from
    step 2's checkpoint (not from its start) and ends with the failure-free weights; every
    later checkpoint, the final one included, fails the same way, and the job exits 0 with a
    warning (--checkpoint-errors warn), the summary listing the failures."""
    p, endpoint = start(tmp_path, "--max-restarts", "1")
    seen = []
    deadline = time.monotonic() + 120
    for line in p.stderr:  # the launcher's notes, as they come
        seen.append(line)
        assert time.monotonic() < deadline, seen
        if "checkpoint of step 4" in line:
            break
    else:
        pytest.fail(f"no checkpoint failure was said: {seen} {finish(p)}")
    assert "failed: No space left on device [ENOSPC]" in line, line
    assert "the latest good checkpoint is step 2" in line and "training goes on" in line
    [eps] = [pid for pid in processes_with(endpoint) if b"eps_server" in
             open(f"/proc/{pid}/cmdline", "rb").read()]
    os.kill(eps, signal.SIGKILL)
    out, err = finish(p)
    err = "".join(seen) + err
    assert p.returncode == 0, err
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["ok"] and s["steps"] == STEPS
    [restart] = s["restarts"]
    assert restart["checkpoint_step"] == 2, restart
    failures = s["checkpoint_failures"]
    assert failures[0]["step"] == 4 and failures[-1]["final"] and failures[-1]["step"] == STEPS
    assert all(f["last_step"] == 2 and "ENOSPC" in f["error"] for f in failures), failures
    assert s["eps"]["checkpoint_failures"] >= 1 and s["eps"]["checkpoints_written"] == 0
    said = [ln for ln in err.splitlines() if "failed: No space left on device" in ln]
    assert len(said) == 2 and said[1].startswith("l2l-launch: final checkpoint of step 8"), err
    assert f"{len(failures)} checkpoint(s) failed" in err and "latest good one is step 2" in err
    logs = tmp_path / "runs" / s["run_id"]
    assert "Traceback" not in (logs / "eps.log").read_text()
    after = tmp_path / "disk.after" / "ck"
    assert sorted(os.listdir(after)) == sorted([checkpoint.LOCK, LATEST, "step-00000002"])
    assert checkpoint.read_meta(resolve(str(after))).state["step"] == 2  # checksums verified
    # the failure-free run (tests/conftest.py; tests/test_recovery.py's killed EPS's too)
    assert (tmp_path / "m.st").read_bytes() == failure_free(*JOB)
    assert_nothing_left(endpoint, s["run_id"])


@pytest.mark.slow
def test_checkpoint_errors_fail_stops_the_job_at_the_first_failure(tmp_path):
    p, endpoint = start(tmp_path, "--checkpoint-errors", "fail")
    out, err = finish(p)
    assert p.returncode == 1, err
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["failure"].startswith("checkpoint of step 4 to ") and "ENOSPC" in s["failure"]
    assert s["failure"].endswith("(--checkpoint-errors fail)") and s["steps"] < STEPS
    assert "stopping the job (--checkpoint-errors fail)" in err
    assert_nothing_left(endpoint, s["run_id"])


def test_a_save_the_disk_cannot_hold_fails_the_job_in_one_line_and_loses_nothing(tmp_path):
    """--save on a full disk at the end: the job fails (exit 1: its model was not written)
    with the worker's one line, no traceback, no partial file; training was complete, so
    the EPS's final checkpoint (--server-save, on another disk) holds the trained weights."""
    why = unshare_works(tmp_path)
    if why:
        pytest.skip(why)
    disk, ck = tmp_path / "disk", tmp_path / "ck"
    disk.mkdir()
    endpoint = f"ipc://{tmp_path}/eps.sock"
    p = subprocess.run(["unshare", "-rm", "sh", "-c", IN_TMPFS.format(size=64), str(disk),
                        *LAUNCH, "--endpoint", endpoint, "--summary-json", str(tmp_path / "s.json"),
                        *JOB, "--server-save", str(ck), "--save", str(disk / "m.st")],
                       env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert p.returncode == 1, p.stderr
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["failure"] == "w0 exited with status 2" and s["save"] is None, s["failure"]
    assert f"could not write the model to {disk / 'm.st'}: No space left on device" in p.stderr
    assert "training is complete" in p.stderr and "Traceback" not in p.stderr
    w0 = (tmp_path / "runs" / s["run_id"] / "w0.log").read_text()
    assert "Traceback" not in w0
    assert os.listdir(tmp_path / "disk.after") == []  # no partial model left
    assert checkpoint.read_meta(str(ck)).state["step"] == STEPS
    assert_nothing_left(endpoint, s["run_id"])


def test_a_save_path_that_cannot_be_written_is_refused_before_training(tmp_path):
    p = subprocess.run([*LAUNCH, *JOB, "--save", "/proc/self/m.st"], env=ENV, cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--save /proc/self/m.st: not writable" in p.stderr, p.stderr
