"""l2l-ctl status: a table of the running job, JSON for scripts, --watch redraws."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from .helpers import ENV, ROOT, SMALL

CTL = [sys.executable, "-m", "launch.ctl"]


def test_status_shows_workers_and_layers_of_a_running_job(cluster):
    cluster.start_server(1, "--heartbeat-timeout", "5")
    # Steps enough to outlast the test on any machine (the job ending would end the EPS under
    # the watch); the cluster kills it at the end.
    w = cluster.worker(0, 1, *SMALL, "--steps", "1000000")
    ctl = [*CTL, "--endpoint", cluster.endpoint, "status"]
    deadline = time.monotonic() + 120
    while True:
        p = subprocess.run([*ctl, "--json"], env=ENV, cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 0, p.stderr
        s = json.loads(p.stdout)
        if s["step"] >= 2 and s["workers"] and s["workers"][0]["report"]:
            break
        assert time.monotonic() < deadline and w.poll() is None, cluster.log(w)
        time.sleep(0.2)
    [worker] = s["workers"]
    assert worker["rank"] == 0 and worker["pid"] == w.pid and worker["host"]
    assert worker["step"] >= s["step"] and 0 <= worker["silent"] < 5
    report = worker["report"]  # the worker's own figures, from its heartbeats
    assert 1 <= report["steps"] <= worker["step"] + 1 and report["samples_per_sec"] > 0
    assert 0 <= report["fetch_wait"] + report["push_wait"] <= report["step_seconds"]
    assert report["memory"] > 0 and report["peak_memory"] > 0
    assert len(s["updated_ms"]) == len(s["versions"]) == 4
    assert all(0 <= ms < 60_000 for ms in s["updated_ms"])
    table = subprocess.run(ctl, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    for title in ("workers", "samples/s", "layers", "last update", "checkpoints 0 written"):
        assert title in table.stdout, table.stdout
    assert s["stats"]["checkpoint_failures"] == 0 and s["stats"]["last_checkpoint_step"] == -1
    watch = subprocess.Popen([*ctl, "--watch", "--json", "--interval", "0.2"], env=ENV,
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = watch.stdout.readline()  # once it is up
        time.sleep(1.5)
    finally:
        watch.send_signal(signal.SIGINT)
        out, err = watch.communicate(timeout=30)
    assert first, err  # it polled at least once before it was interrupted
    polls = [json.loads(line) for line in [first, *out.splitlines()]]
    assert len(polls) >= 3 and polls[-1]["step"] >= polls[0]["step"]
    assert watch.returncode == 0, err
    tables = subprocess.Popen([*ctl, "--watch", "--interval", "0.2"], env=ENV, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(3.0)
    tables.terminate()  # into a pipe, each poll's table was written out as it came
    out, err = tables.communicate(timeout=30)
    assert out.count("last update") >= 2, (out, err)
    w.kill()


def test_status_of_a_socket_nobody_serves_says_so_at_once(tmp_path):
    t0 = time.monotonic()
    p = subprocess.run([*CTL, "--endpoint", f"ipc://{tmp_path}/none.sock", "status"], env=ENV,
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "no eps-server listens on" in p.stderr, p.stderr
    assert time.monotonic() - t0 < 8  # not after the 10 s reply timeout


def test_status_shows_failed_checkpoints():
    from launch.status import checkpoints

    assert checkpoints({}) == "checkpoints 0 written, last step -1"
    text = checkpoints({"checkpoints_written": 3, "checkpoint_failures": 2,
                        "last_checkpoint_step": 4})
    assert text.startswith("checkpoints 3 written, last step 4") and "2 failed" in text
