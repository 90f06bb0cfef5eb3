"""The container deployment: compose files are valid and their commands are real CLI calls."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from eps_server.__main__ import parse as server_parse
from worker.__main__ import parse as worker_parse

from .helpers import ROOT

COMPOSE = ROOT / "docker-compose.yml"
GPU = ROOT / "deploy" / "compose.gpu.yml"


def merged(*files) -> dict:
    """The compose model after `docker-compose config` (anchors and overrides applied)."""
    args = [a for f in files for a in ("-f", str(f))]
    out = subprocess.run(["docker-compose", *args, "config"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


needs_compose = pytest.mark.skipif(shutil.which("docker-compose") is None,
                                   reason="docker-compose is not installed (.ci/run installs it)")


@needs_compose
@pytest.mark.parametrize("files", [(COMPOSE,), (COMPOSE, GPU)], ids=["cpu", "gpu"])
def test_compose_config_is_valid_and_commands_parse(files):
    services = merged(*files)["services"]
    assert set(services) == {"eps", "worker-0", "worker-1"}
    eps = services["eps"]
    assert eps["ipc"] == "shareable" and eps.get("shm_size")
    server = server_parse(eps["command"][1:]).server
    assert eps["command"][0] == "eps-server" and server.world_size == 2
    for rank in (0, 1):
        w = services[f"worker-{rank}"]
        assert w["ipc"] == "service:eps"
        assert w["command"][0] == "l2l-worker"
        args = worker_parse(w["command"][1:]).worker
        assert (args.rank, args.world_size, args.endpoint) == (rank, 2, server.endpoint)
        if files[-1] == GPU:
            assert args.device == "cuda:0"


def test_compose_file_parses_as_yaml():
    """Runs without docker-compose too: the file is YAML with the three services."""
    doc = yaml.safe_load(COMPOSE.read_text())
    assert {"eps", "worker-0", "worker-1"} <= set(doc["services"])
