"""A worker on a box without an EPS reaches one over tcp with CURVE and frames: box 1 of a
two-box loopback job runs only its EPS (``l2l-launch --role eps``, a tcp endpoint, CURVE keys
from ``l2l-ctl keygen``), and its worker is a process of its own (``l2l-launch --role
worker``, transport frames: no shared memory with that EPS), while box 0 runs as usual. The
job trains as one box of two workers does."""

from __future__ import annotations

import json
import os
import signal
import subprocess

from safetensors.torch import load_file

from protocol import curve

from .baseline import assert_close
from .helpers import ENV, free_port
from .test_boxes import JOB
from .test_launch import LAUNCH, assert_nothing_left


def test_box_1_s_worker_reaches_its_eps_over_tcp_with_curve_and_frames(tmp_path):
    keys = tmp_path / "keys"
    for name in ("eps", "w0"):  # as l2l-ctl keygen KEYS NAME writes them
        curve.generate(str(keys), name)
    (keys / "clients").mkdir()
    (keys / "clients" / "w0.key").write_bytes((keys / "w0.key").read_bytes())
    boxes = ["--nodes", "2", "--master-port", str(free_port())]
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    dirs = [tmp_path / "box0", tmp_path / "box1", tmp_path / "ref", tmp_path / "remote"]
    for d in dirs:
        d.mkdir(mode=0o700)
    argvs = [
        [*LAUNCH, "--endpoint", f"ipc://{dirs[0]}/eps.sock", "--summary-json",
         str(dirs[0] / "s.json"), "--workers", "1", *boxes, "--node-rank", "0", *JOB,
         "--save", str(dirs[0] / "m.st")],
        [*LAUNCH, "--role", "eps", "--endpoint", endpoint, "--workers", "1", *boxes,
         "--node-rank", "1", *JOB, "--curve-secret-key", str(keys / "eps.key_secret"),
         "--curve-clients", str(keys / "clients")],
        [*LAUNCH, "--workers", "2", *JOB, "--save", str(dirs[2] / "m.st")],  # the reference
        [*LAUNCH, "--role", "worker", "--endpoint", endpoint, "--workers", "1", "--rank", "0",
         *boxes, "--node-rank", "1", *JOB, "--transport", "frames", "--curve-server-key",
         str(keys / "eps.key"), "--curve-key", str(keys / "w0.key_secret")],
    ]
    procs = []
    for argv, d in zip(argvs, dirs):
        with open(d / "out", "w") as out:
            procs.append(subprocess.Popen(argv, env=ENV, cwd=d, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    try:
        results = [(p.wait(timeout=240), (d / "out").read_text()) for p, d in zip(procs, dirs)]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for name, (code, err) in zip(("box 0", "box 1's EPS", "reference", "box 1's worker"),
                                 results):
        assert code == 0, f"{name}: {err}"
    eps = results[1][1]  # --role eps logs to stderr
    assert "hello from rank 0" in eps and ", frames)" in eps, eps
    assert eps.count("the 2 boxes' replicas are identical") == 3, eps  # steps 0, 2, 4
    assert_close(load_file(str(dirs[0] / "m.st")), load_file(str(dirs[2] / "m.st")),
                 atol=1e-5, rtol=1e-4)
    s = json.loads((dirs[0] / "s.json").read_text())
    assert s["ok"] and s["steps"] == 6
    assert_nothing_left(f"ipc://{dirs[0]}/eps.sock", s["run_id"])
    [run] = os.listdir(dirs[1] / "runs")
    assert_nothing_left(endpoint, run)
    worker = json.loads(next((dirs[3] / "runs").glob("*/worker-0.json")).read_text())
    assert worker["rank"] == 0 and len(worker["losses"]) == 6
