"""Real processes for multi-process tests: eps-server, l2l-worker, l2l-launch.

Every process is started in its own session with a timeout, and ``Cluster.close`` kills them
all (whole process groups) and removes the run's shared memory, whatever the test did.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from protocol.events import Ready, wait_for
from protocol.shm import list_regions, unlink_prefix

ROOT = Path(__file__).resolve().parents[1]
# L2L_PARENT_PID: an EPS or worker outlives no test run, even one killed (as l2l-launch's).
# (Without pytest-xdist's marks: a pytest run a test starts is no xdist worker of this one.)
ENV = dict({k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")},
           OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", L2L_PARENT_PID=str(os.getpid()),
           PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def inner_pytest(test_file: Path, *options: str) -> subprocess.CompletedProcess:
    """A pytest run of its own over ``test_file`` in 2 xdist processes, with this suite's
    conftest (its exclusive turns, its leak check): its own controller (ENV carries no xdist
    marks) and its own session mark (an outer test's regions are not its leaks)."""
    env = {k: v for k, v in ENV.items() if k != "L2L_TEST_SESSION"}
    env.update(PYTHONPATH=str(ROOT))
    tmp = test_file.parent
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-n", "2",
                           "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp), *options,
                           str(test_file)], cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=120)


# A small model: hidden 32, 2 blocks; every process uses one torch thread.
SMALL = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--vocab", "64",
         "--micro-batch-size", "4", "--threads", "1"]


class Cluster:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.run_id = "t" + secrets.token_hex(4)
        self.sock_dir = tempfile.mkdtemp(prefix="l2lt-")  # short: unix socket paths are limited
        self.endpoint = f"ipc://{self.sock_dir}/eps.sock"
        self.procs: list[subprocess.Popen] = []
        self.server: subprocess.Popen | None = None

    def spawn(self, argv: list[str], name: str) -> subprocess.Popen:
        out = open(self.tmp / f"{name}.log", "w")
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=ENV, cwd=self.tmp,
                             start_new_session=True)
        p.log_path = self.tmp / f"{name}.log"
        self.procs.append(p)
        return p

    def log(self, p: subprocess.Popen) -> str:
        return p.log_path.read_text()

    def start_server(self, world_size: int = 1, *extra: str, timeout: float = 60,
                     workers=None):
        """Start the EPS and wait until it is ready; ``workers()``, if given, is called
        between the two (workers wait for the EPS: their start-up overlaps its own)."""
        events = self.tmp / f"eps-{len(self.procs)}.events"
        self.server = self.spawn(
            [sys.executable, "-m", "eps_server", "--endpoint", self.endpoint, "--world-size",
             str(world_size), "--run-id", self.run_id, "--exit-when-done",
             "--server-threads", "1",  # the suite's processes share a few cores
             "--events", str(events), *extra], "eps")
        if workers:
            workers()
        try:
            wait_for(str(events), Ready, self.server, timeout)
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"eps-server not ready ({e}):\n" + self.log(self.server)) from None
        return self.server

    def worker(self, rank: int, world_size: int, *extra: str) -> subprocess.Popen:
        return self.spawn([sys.executable, "-m", "worker", "--endpoint", self.endpoint,
                           "--rank", str(rank), "--world-size", str(world_size), *extra],
                          f"w{rank}")

    def wait(self, p: subprocess.Popen, timeout: float = 120) -> int:
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"process timed out; log:\n{self.log(p)}") from None

    def run_job(self, world_size: int, *worker_args: str, server_args=(), timeout=180):
        """Server + world_size workers; waits for all; asserts success."""
        workers: list[subprocess.Popen] = []
        self.start_server(world_size, *server_args, workers=lambda: workers.extend(
            self.worker(r, world_size, *worker_args) for r in range(world_size)))
        for w in workers:
            code = self.wait(w, timeout)
            assert code == 0, f"worker failed ({code}):\n{self.log(w)}"
        code = self.wait(self.server, 60)
        assert code == 0, f"server failed ({code}):\n{self.log(self.server)}"

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        unlink_prefix(f"l2l-{self.run_id}-")
        shutil.rmtree(self.sock_dir, ignore_errors=True)

    def leftover_regions(self) -> list[str]:
        return list_regions(f"l2l-{self.run_id}-")


def free_port() -> int:
    """A loopback tcp port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pids_alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        try:  # a zombie is not alive
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[-1].startswith("Z"):
                    continue
        except FileNotFoundError:
            continue
        alive.append(pid)
    return alive
