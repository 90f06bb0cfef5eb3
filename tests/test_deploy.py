"""The container deployment: the compose files are valid, their settings follow .env and the
job (shm_size from the plan), and their commands, run here as plain processes exactly as the
containers would run them, train the job."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import yaml
from safetensors.torch import load_file

from launch.config import LaunchArgs
from launch.plan import recommended, shm_regions
from protocol import cli

from .helpers import ENV, ROOT, free_port

COMPOSE = ROOT / "docker-compose.yml"
GPU = ROOT / "deploy" / "compose.gpu.yml"
SOCKET = "ipc:///run/l2l/eps.sock"


def dotenv() -> dict[str, str]:
    lines = (ROOT / ".env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and line[0] != "#")


def merged(*files) -> dict:
    """The compose model after `docker-compose config` (anchors, .env and overrides applied)."""
    args = [a for f in files for a in ("-f", str(f))]
    env = {k: v for k, v in os.environ.items() if not k.startswith("L2L_")}  # .env's values
    out = subprocess.run(["docker-compose", *args, "config"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def host_path(service: dict, path: str) -> str:
    """The host side of the bind mount that puts ``path`` in the container."""
    for v in service["volumes"]:
        source, target = v.split(":")[:2]
        if target == path:
            return source
    raise AssertionError(f"nothing is mounted at {path}")


def job_args(service: dict, *extra: str) -> LaunchArgs:
    argv = [host_path(service, "/job.yaml") if a == "/job.yaml" else a
            for a in service["command"][1:]]
    return cli.parse(LaunchArgs, [*argv, *extra], "l2l-launch")


def size_bytes(value) -> int:
    """A compose size ("64m", or bytes as docker-compose config prints it)."""
    if isinstance(value, int):
        return value
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    v = str(value).lower().rstrip("b")
    return int(float(v[:-1]) * units[v[-1]]) if v[-1] in units else int(v)


needs_compose = pytest.mark.skipif(shutil.which("docker-compose") is None,
                                   reason="docker-compose is not installed (.ci/run installs it)")


@needs_compose
@pytest.mark.parametrize("files", [(COMPOSE,), (COMPOSE, GPU)], ids=["cpu", "gpu"])
def test_compose_config_follows_env_and_job(files):
    env = dotenv()
    services = merged(*files)["services"]
    assert set(services) == {"eps", "worker"}
    eps, worker = services["eps"], services["worker"]
    n = int(env["L2L_WORKERS"])
    assert worker["deploy"]["replicas"] == n
    assert eps["ipc"] == "shareable" and worker["ipc"] == "service:eps"
    assert worker["network_mode"] == "none"
    assert worker.get("pull_policy", "never") == "never"  # (v1 drops it from merged files)
    assert worker["depends_on"]["eps"]["condition"] == "service_healthy"
    assert eps["restart"] == worker["restart"] and eps["restart"].startswith("on-failure")
    assert all(p.startswith("127.0.0.1:") for p in eps["ports"])  # metrics: host loopback
    for service in (eps, worker):
        assert {"/data/runs", "/data/checkpoints", "/run/l2l"} <= {
            v.split(":")[1] for v in service["volumes"]}
    server, w = job_args(eps), job_args(worker)
    assert (server.launch.role, w.launch.role) == ("eps", "worker")
    assert server.launch.workers == w.launch.workers == n
    assert server.launch.run_id == w.launch.run_id == env["L2L_RUN_ID"]
    assert server.launch.endpoint == w.launch.endpoint == SOCKET and w.launch.rank == -1
    assert server.server.save == "/data/checkpoints"  # the checkpoint volume
    assert server.launch.runs_dir == "/data/runs" and server.launch.save.startswith("/data/runs")
    # The health check is a real l2l-ctl call on the EPS's socket.
    check = eps["healthcheck"]["test"]
    assert check[:2] == ["CMD", "l2l-ctl"] and SOCKET in check and "status" in check
    from launch.ctl import parser as ctl_parser
    assert ctl_parser().parse_args(check[2:]).endpoint == SOCKET
    # shm_size holds every region the EPS will create, with headroom.
    rows = shm_regions(server)
    assert size_bytes(eps["shm_size"]) >= recommended(rows, n) > sum(r.nbytes for r in rows)
    if files[-1] == GPU:
        assert eps["build"]["args"]["VARIANT"] == "cuda" and w.worker.device == "cuda"
        [device] = worker["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["count"] == "all"
    else:
        assert eps["build"]["args"]["VARIANT"] == "cpu" and w.worker.device == "cpu"


def test_the_dockerfile_builds_both_variants():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "ARG VARIANT=cpu" in text and "FROM base-${VARIANT}" in text
    assert "AS base-cpu" in text and "AS base-cuda" in text


def test_the_plan_is_the_shared_memory_the_eps_creates(tmp_path):
    """--plan's regions add up to exactly what a running EPS (bf16, recovery, 2 workers, shm)
    has in /dev/shm once both workers joined."""
    run_id = "plan" + os.urandom(3).hex()
    args = ["--workers", "2", "--model", "gpt", "--layers", "2", "--hidden", "32", "--heads",
            "2", "--vocab", "64", "--seq-len", "16", "--precision", "bf16", "--max-restarts",
            "1", "--run-id", run_id]
    plan = subprocess.run([sys.executable, "-m", "launch", *args, "--plan"], env=ENV,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    expected = sum(r.nbytes for r in shm_regions(cli.parse(LaunchArgs, args, "l2l-launch")))
    assert plan.stdout.splitlines()[-1].startswith("L2L_SHM_SIZE=")
    p = subprocess.Popen([sys.executable, "-m", "launch", *args, "--steps", "100000", "--quiet",
                          "--threads", "1", "--runs-dir", str(tmp_path)], env=ENV,
                         cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         start_new_session=True)
    seen = 0
    try:
        for _ in range(600):
            if os.path.exists(tmp_path / run_id / "config.json"):
                sizes = [os.stat(f"/dev/shm/{n}").st_size for n in os.listdir("/dev/shm")
                         if n.startswith(f"l2l-{run_id}-") and not n.endswith("-lock")]
                seen = max(seen, sum(sizes))
                if seen >= expected and len(sizes) == 6:  # master, bf16, versions, retained,
                    break                                 # one gradient region per worker
            assert p.poll() is None, p.stderr.read()
            subprocess.run(["sleep", "0.1"])
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 15)
        p.wait(60)
    assert seen == expected


@pytest.mark.parametrize("precision, extra", [
    ("fp32", ("--freeze", "pre.*,blocks.0.*")), ("bf16", ("--freeze", "pre.*,blocks.0.*")),
    ("bf16", ("--nodes", "2", "--node-rank", "1", "--eps-mode", "shard"))])
def test_the_plan_of_a_frozen_or_sharded_job_is_what_its_store_creates(precision, extra):
    """The master holds the trained tensors (or this box's part of them; fp32 unsharded: all,
    served as they are), the served copy is then a region of its own (in shard mode even in
    fp32), and a gradient slot holds a layer's trained part: --plan says what the EPS's
    LayerStore makes of it, to the byte."""
    import secrets

    from eps_server.layer_store import LayerStore
    from launch.roles import server_config
    from worker.models import build_model

    args = cli.parse(LaunchArgs, ["--workers", "2", "--model", "gpt", "--layers", "3",
                                  "--hidden", "32", "--heads", "2", "--vocab", "64",
                                  "--seq-len", "16", "--precision", precision, *extra],
                     "l2l-launch")
    server = server_config(args, "", "plan")
    store = LayerStore(build_model(args.model).manifest(), "p" + secrets.token_hex(4),
                       server.compute_dtype, retain=server.recovery,
                       sharding=server.boxes.sharding)
    try:
        grads = server.compute_dtype if args.worker.grad_dtype == "compute" else "float32"
        for rank in range(2):
            store.grad_region(rank, grads, server.grad_slots)
        made = sum(region.nbytes for region in store._regions)
    finally:
        store.close()
    assert made == sum(r.nbytes for r in shm_regions(args))


class ComposeJob:
    """The eps and worker commands of docker-compose.yml (parsed from the file, .env
    substituted as compose does), run as plain processes with the container paths mapped to
    temporary ones; a worker that fails is started again, as ``restart: on-failure`` does."""

    def __init__(self, tmp_path, steps: int, *extra: str):
        self.tmp = tmp_path
        self.doc = yaml.safe_load(COMPOSE.read_text())
        self.env = dotenv()
        self.workers = int(self.env["L2L_WORKERS"])
        self.sock = tempfile.mkdtemp(prefix="l2ld-")  # short: unix socket paths are limited
        os.chmod(self.sock, 0o700)
        self.port = str(free_port())
        self.extra = ["--runs-dir", str(tmp_path / "runs"), "--save",
                      str(tmp_path / "runs" / "model.safetensors"), "--server-save",
                      str(tmp_path / "checkpoints"), "--steps", str(steps), "--threads", "1",
                      *extra]
        self.procs: list[subprocess.Popen] = []
        self.logs = []

    def argv(self, service: str) -> list[str]:
        out = []
        for a in self.doc["services"][service]["command"]:
            for k, v in self.env.items():
                a = a.replace(f"${{{k}:?set {k} in .env}}", v).replace(f"${{{k}:-demo}}", v)
            out.append({"/job.yaml": str(ROOT / self.env["L2L_JOB"]),
                        SOCKET: f"ipc://{self.sock}/eps.sock", "0.0.0.0": "127.0.0.1",
                        "9400": self.port}.get(a, a))
        assert out[0] == "l2l-launch" and "$" not in " ".join(out), out
        return [sys.executable, "-m", "launch", *out[1:], *self.extra]

    def spawn(self, argv: list[str]) -> subprocess.Popen:
        self.logs.append(open(self.tmp / f"p{len(self.procs)}.log", "w+"))
        self.procs.append(subprocess.Popen(argv, env=ENV, cwd=self.tmp, stdout=self.logs[-1],
                                           stderr=subprocess.STDOUT, start_new_session=True))
        return self.procs[-1]

    def log(self, p) -> str:
        f = self.logs[self.procs.index(p)]
        f.seek(0)
        return f.read()

    def run(self, first_workers=(), timeout: float = 240) -> list[subprocess.Popen]:
        """Run the job; ``first_workers``: extra arguments of the first replicas' commands
        (their replacements get none). Returns the replacements started."""
        eps = self.spawn(self.argv("eps"))
        workers = [self.spawn(self.argv("worker") + list(first_workers))
                   for _ in range(self.workers)]
        restarted = []
        deadline = time.monotonic() + timeout
        try:
            while eps.poll() is None or any(w.poll() is None for w in workers):
                for i, w in enumerate(workers):
                    if w.poll() not in (None, 0):  # the restart policy
                        assert len(restarted) < 2, self.log(w)
                        workers[i] = self.spawn(self.argv("worker"))
                        restarted.append(workers[i])
                assert time.monotonic() < deadline, self.log(eps)
                time.sleep(0.1)
            assert eps.returncode == 0, self.log(eps)
            return restarted
        finally:
            for p in self.procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()
            shutil.rmtree(self.sock, ignore_errors=True)


def test_the_compose_job_runs_here(tmp_path):
    """The workers are identical replicas, ranks are assigned by the EPS, and the job trains,
    saves the model and the run's files."""
    job = ComposeJob(tmp_path, 4)
    assert job.run() == []
    run = tmp_path / "runs" / job.env["L2L_RUN_ID"]
    summaries = [json.loads((run / f"worker-{r}.json").read_text()) for r in range(job.workers)]
    assert [s["rank"] for s in summaries] == list(range(job.workers))
    assert all(s["steps"] == 4 for s in summaries)
    assert load_file(str(tmp_path / "runs" / "model.safetensors"))
    assert json.loads((run / "config.json").read_text())["launch"]["role"] == "eps"
    assert (tmp_path / "checkpoints" / "latest").exists()


@pytest.mark.slow
def test_a_restarted_replica_takes_the_dead_ones_rank_and_the_model_is_exact(tmp_path):
    """Rank 1's container dies in the backward of step 2; the restart policy starts the same
    command again: it waits until the EPS declares the dead one gone, takes rank 1, redoes the
    step, and the final model is bitwise the one of a run without the failure."""
    fast = ("--heartbeat-timeout", "2")
    for d in "ab":
        (tmp_path / d).mkdir()
    assert ComposeJob(tmp_path / "a", 5, *fast).run() == []
    job = ComposeJob(tmp_path / "b", 5, *fast)
    [replacement] = job.run(first_workers=("--fault", "1:2:B1"))
    assert "rank 1: rejoined run" in job.log(replacement)
    want, got = (load_file(str(tmp_path / d / "runs" / "model.safetensors")) for d in "ab")
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
