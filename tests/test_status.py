"""l2l-ctl status: a table of the running job, JSON for scripts, --watch redraws."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

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
    # a reader that goes away (| head -1) ends the watch quietly
    head = subprocess.Popen([*ctl, "--watch", "--json", "--interval", "0.2"], env=ENV, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert json.loads(head.stdout.readline())["step"] >= 0
        head.stdout.close()
        err = head.stderr.read()
        assert head.wait(timeout=30) == 0 and "Traceback" not in err and "Broken" not in err, err
    finally:
        head.kill()
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


def test_status_shows_peers_words_as_they_are():
    """A worker's host name is its own to say: "[/]" made l2l-ctl status fail (rich markup)."""
    from rich.console import Console

    from launch.status import render
    from protocol.box_info import BoxInfo
    from protocol.messages import StatusReply, WorkerInfo

    hosts = ["[/]", "[bold red]not bold", "[link=file:///etc]x[/link]"]
    reply = StatusReply(req_id=1, run_id="r1", step=0, versions=(0,), world_size=3,
                        ranks=(0, 1, 2), stats={}, workers=tuple(
                            WorkerInfo(rank=i, pid=1, host=h, step=0, silent=0.0)
                            for i, h in enumerate(hosts)),
                        boxes=tuple(BoxInfo(box=i, state="ok", age=1.0, host=h)
                                    for i, h in enumerate(hosts[:2])))
    console = Console(record=True, width=300)
    console.print(render(reply))
    text = console.export_text()
    assert all(h in text for h in hosts), text


def test_status_finds_the_launched_job_without_its_endpoint(tmp_path):
    """l2l-launch keeps its (private) endpoint in runs/<id>/endpoint while the job runs:
    l2l-ctl status finds the job there from the same directory, and the file is gone with
    the job."""
    p = subprocess.Popen([sys.executable, "-m", "launch", "--steps", "1000000", *SMALL],
                         env=ENV, cwd=tmp_path, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        note = p.stderr.readline()  # "l2l-launch: run ID, logs in ...; watch it with: ..."
        run_id = note.split("run ", 1)[1].split(",")[0]
        assert f"watch it with: l2l-ctl status --run {run_id}" in note, note
        endpoint = tmp_path / "runs" / run_id / "endpoint"
        assert endpoint.read_text().startswith("ipc://")
        deadline = time.monotonic() + 120
        while True:  # until the EPS answers
            s = subprocess.run([*CTL, "status", "--json"], env=ENV, cwd=tmp_path,
                               capture_output=True, text=True, timeout=60)
            if s.returncode == 0:
                break
            assert time.monotonic() < deadline and p.poll() is None, s.stderr
            time.sleep(0.5)
        assert json.loads(s.stdout)["run_id"] == run_id
        by_id = subprocess.run([*CTL, "--run", run_id, "status", "--json"], env=ENV,
                               cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert by_id.returncode == 0 and json.loads(by_id.stdout)["run_id"] == run_id
    finally:
        p.send_signal(signal.SIGINT)
        p.communicate(timeout=60)
    assert p.returncode == 130 and not endpoint.exists()
    gone = subprocess.run([*CTL, "status"], env=ENV, cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert gone.returncode == 1 and "no l2l-launch job runs under runs/" in gone.stderr


def test_status_asks_which_job_when_several_run(tmp_path, capsys):
    """Two jobs running (their endpoint files locked), one whose launcher was killed (its file
    left, unlocked): l2l-ctl names the two and asks for --run; --run picks one."""
    from launch import ctl
    from launch.rundir import publish_endpoint, withdraw_endpoint

    runs = tmp_path / "runs"
    for run in ("a", "b"):
        publish_endpoint(str(runs / run), f"ipc://{tmp_path}/{run}.sock")
    (runs / "dead").mkdir()
    (runs / "dead" / "endpoint").write_text(f"ipc://{tmp_path}/dead.sock\n")
    try:
        with pytest.raises(SystemExit) as e:
            ctl.main(["--runs-dir", str(runs), "status"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"2 jobs run under {runs}/: a, b; pick one with --run" in err
        assert err.count("\n") <= 2  # the error, not a page of usage
        assert ctl.main(["status", "--runs-dir", str(runs), "--run", "b"]) == 1
        assert f"no eps-server listens on ipc://{tmp_path}/b.sock" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            ctl.main(["--runs-dir", str(runs), "--run", "dead", "status"])
        assert "no job dead runs under" in capsys.readouterr().err
    finally:
        for run in ("a", "b"):
            withdraw_endpoint(str(runs / run))
    assert not (runs / "a" / "endpoint").exists()
