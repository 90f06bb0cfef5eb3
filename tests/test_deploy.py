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

import pytest
import yaml
from safetensors.torch import load_file

from launch.config import LaunchArgs
from launch.plan import HEADROOM, shm_regions
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
    assert eps["restart"] == worker["restart"] == "on-failure"
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
    need = sum(b for _, b in shm_regions(server))
    assert size_bytes(eps["shm_size"]) >= need * HEADROOM
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
    expected = sum(b for _, b in shm_regions(cli.parse(LaunchArgs, args, "l2l-launch")))
    assert plan.stdout.splitlines()[-1].startswith("L2L_SHM_SIZE=")
    p = subprocess.Popen([sys.executable, "-m", "launch", *args, "--steps", "400", "--quiet",
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


def test_the_compose_job_runs_here(tmp_path):
    """The eps and worker commands of docker-compose.yml (as `docker-compose config` would give
    them; parsed from the file when docker-compose is missing), run as plain processes with
    the container paths mapped to temporary ones: the workers are identical replicas, ranks are
    assigned by the EPS, and the job trains, saves the model and the run's files."""
    doc = yaml.safe_load(COMPOSE.read_text())
    env = dotenv()
    n = int(env["L2L_WORKERS"])
    sock = tempfile.mkdtemp(prefix="l2ld-")  # short: unix socket paths are limited
    os.chmod(sock, 0o700)
    port = str(free_port())

    def argv(service: str) -> list[str]:
        out = []
        for a in doc["services"][service]["command"]:
            for k, v in env.items():
                a = a.replace(f"${{{k}:?set {k} in .env}}", v).replace(f"${{{k}:-demo}}", v)
            a = {"/job.yaml": str(ROOT / env["L2L_JOB"]), SOCKET: f"ipc://{sock}/eps.sock",
                 "0.0.0.0": "127.0.0.1", "9400": port}.get(a, a)
            out.append(a)
        assert out[0] == "l2l-launch" and "$" not in " ".join(out), out
        paths = ["--runs-dir", str(tmp_path / "runs"), "--save",
                 str(tmp_path / "runs" / "model.safetensors"), "--server-save",
                 str(tmp_path / "checkpoints")]
        return [sys.executable, "-m", "launch", *out[1:], *paths, "--steps", "4", "--threads",
                "1", "--heartbeat-timeout", "5"]

    logs = []

    def spawn(cmd, name):
        logs.append(open(tmp_path / f"{name}.log", "w+"))
        return subprocess.Popen(cmd, env=ENV, cwd=tmp_path, stdout=logs[-1],
                                stderr=subprocess.STDOUT, start_new_session=True)

    procs = [spawn(argv("eps"), "eps")]
    procs += [spawn(argv("worker"), f"worker{i}") for i in range(n)]
    try:
        for p, log in zip(procs[1:] + procs[:1], logs[1:] + logs[:1]):
            code = p.wait(240)
            log.seek(0)
            assert code == 0, log.read()
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
        shutil.rmtree(sock, ignore_errors=True)
    run = tmp_path / "runs" / env["L2L_RUN_ID"]
    summaries = [json.loads((run / f"worker-{r}.json").read_text()) for r in range(n)]
    assert [s["rank"] for s in summaries] == list(range(n))
    assert all(s["steps"] == 4 for s in summaries)
    assert load_file(str(tmp_path / "runs" / "model.safetensors"))
    assert json.loads((run / "config.json").read_text())["launch"]["role"] == "eps"
    assert (tmp_path / "checkpoints" / "latest").exists()
