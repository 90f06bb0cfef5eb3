"""l2l-launch: trains (and learns), writes its summary, and leaves no process and no shared
memory behind: on success, when a worker dies, on Ctrl-C, and when the launcher itself is
killed."""

from __future__ import annotations

import io
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from protocol.lifecycle import REFUSED
from protocol.shm import list_regions
from protocol.tensors import plan_layout
from worker.config import ModelConfig
from worker.data import MarkovTask
from worker.models import build_model

from .helpers import ENV, ROOT, SMALL, pids_alive

LAUNCH = [sys.executable, "-m", "launch", "--quiet"]


def processes_with(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (our children carry the run's endpoint)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return pids_alive(found)


def launch(tmp_path, *args, timeout=240):
    endpoint = f"ipc://{tmp_path}/eps.sock"
    summary = tmp_path / "summary.json"
    p = subprocess.run([*LAUNCH, "--endpoint", endpoint, "--summary-json", str(summary), *args],
                       env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    return p, json.loads(summary.read_text()), endpoint


def assert_nothing_left(endpoint: str, run_id: str) -> None:
    deadline = time.monotonic() + 10
    while processes_with(endpoint) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_with(endpoint), "processes of the run are still alive"
    assert not list_regions(f"l2l-{run_id}-"), "shared memory of the run is left"


def test_bert_learns_the_planted_rule(tmp_path):
    """2 workers, 80 steps: accuracy over the last 10 steps >= 0.9 (chance: 0.25)."""
    p, s, endpoint = launch(tmp_path, "--workers", "2", "--model", "bert", "--steps", "80",
                            "--micro-batches", "2", *SMALL[:-4], "--micro-batch-size", "8",
                            "--lr", "3e-3", "--save", str(tmp_path / "m.safetensors"))
    assert p.returncode == 0, p.stderr
    assert s["ok"] and s["world_size"] == 2 and s["steps"] == 80 and len(s["losses"]) == 80
    assert s["samples_per_sec"] > 0
    assert [w["rank"] for w in s["workers"]] == [0, 1]
    assert all(w["peak_memory_bytes"] > 0 for w in s["workers"])
    # Layers already published are read straight from shared memory, without a round trip.
    assert all(w["fetches_without_round_trip"] > 0 for w in s["workers"])
    assert sum(s["accuracy"][-10:]) / 10 >= 0.9
    assert s["losses"][0] > 1.2 and sum(s["losses"][-10:]) / 10 < 0.3
    assert (tmp_path / "m.safetensors").exists()
    assert "done: 80 steps" in p.stdout
    assert_nothing_left(endpoint, s["run_id"])


def test_gpt_learns_the_markov_language(tmp_path):
    """Next-token loss falls from ln(64) = 4.16 to below 1.5 (the chain's entropy is ~0.73)."""
    p, s, endpoint = launch(tmp_path, "--workers", "1", "--model", "gpt", "--steps", "80",
                            "--micro-batches", "4", *SMALL[:-4], "--micro-batch-size", "8",
                            "--lr", "3e-3")
    assert p.returncode == 0, p.stderr
    entropy = MarkovTask(ModelConfig(model="gpt", vocab=64)).entropy
    assert s["losses"][0] > math.log(64) - 0.2
    assert sum(s["losses"][-10:]) / 10 < 1.5
    assert s["model"]["params"] > 0 and "classes" not in s["model"]  # a language model
    # fp32, nothing frozen: master (served) and AdamW's m, v for every element, 12 B, and each
    # layer's step count (test_freeze.py: a frozen tensor's 4 B)
    layout = plan_layout(build_model(ModelConfig(model="gpt", layers=2, hidden=32, heads=2,
                                                 seq_len=16, vocab=64)).manifest())
    assert s["eps"]["model_bytes"] == 12 * layout.total_numel + 4 * len(layout.layers)
    assert entropy < 1.0
    # each step's waits (for weights, for pushes' acks) of its slowest worker
    assert len(s["fetch_wait"]) == len(s["push_wait"]) == 80
    assert min(s["fetch_wait"] + s["push_wait"]) >= 0
    assert sum(s["fetch_wait"] + s["push_wait"]) < s["elapsed_seconds"]
    assert_nothing_left(endpoint, s["run_id"])


def start(tmp_path, steps="100000"):
    endpoint = f"ipc://{tmp_path}/eps.sock"
    summary = tmp_path / "summary.json"
    p = subprocess.Popen([*LAUNCH, "--endpoint", endpoint, "--summary-json", str(summary),
                          "--workers", "2", "--steps", steps, *SMALL],
                         env=ENV, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    deadline = time.monotonic() + 90
    for line in p.stdout:  # wait until training is under way
        if line.startswith("step ") and "/" in line:
            break
        assert time.monotonic() < deadline
    return p, endpoint, summary


def run_id_of(endpoint: str) -> str:
    for pid in processes_with(endpoint):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
        if "--run-id" in argv:
            return argv[argv.index("--run-id") + 1]
    raise AssertionError("no eps-server found")


def worker_pid(endpoint: str, rank: int) -> int:
    for pid in processes_with(endpoint):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
        if "worker" in argv and argv[argv.index("--rank") + 1] == str(rank):
            return pid
    raise AssertionError(f"worker {rank} not found")


@pytest.fixture
def reap():
    procs = []
    yield procs
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_a_dead_worker_stops_the_job_cleanly(tmp_path, reap):
    p, endpoint, summary = start(tmp_path)
    reap.append(p)
    run_id = run_id_of(endpoint)
    os.kill(worker_pid(endpoint, 1), signal.SIGKILL)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 1
    assert "w1 was killed by SIGKILL" in err
    s = json.loads(summary.read_text())
    assert not s["ok"] and "w1" in s["failure"]
    assert_nothing_left(endpoint, run_id)


def test_ctrl_c_stops_everything(tmp_path, reap):
    p, endpoint, summary = start(tmp_path)
    reap.append(p)
    run_id = run_id_of(endpoint)
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=60)
    assert p.returncode == 130
    assert_nothing_left(endpoint, run_id)
    s = json.loads(summary.read_text())  # the steps it trained, though no worker summed up
    assert s["steps"] >= 1 and s["samples_per_sec"] > 0
    for w in ("w0", "w1"):  # the workers are stopped before the EPS: their Bye is answered
        assert "bye not acknowledged" not in (tmp_path / "runs" / run_id / f"{w}.log").read_text()


def test_a_worker_that_has_finished_ignores_sigterm(tmp_path):
    """A launcher stops every child when one fails, also workers already on their way out: a
    SIGTERM after the worker's run returned must not unwind again (inside the interpreter's
    exit handlers it printed a traceback and cut finalizers short)."""
    code = ("import os, signal, sys\n"
            "from worker.__main__ import main\n"
            f"code = main(['--endpoint', 'ipc://{tmp_path}/none.sock', '--eps-timeout', '1',"
            " '--model', 'bert'])\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "print('exiting with', code)\n"
            "sys.exit(code)\n")
    p = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 1 and "exiting with 1" in p.stdout, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr and "no reply from the EPS" in p.stderr, p.stderr


def test_a_killed_launcher_takes_its_children_along(tmp_path, reap):
    """Children die with their parent (PR_SET_PDEATHSIG): the EPS gets SIGTERM and unlinks
    its shared memory even though the launcher had no chance to clean up; a worker gets
    SIGKILL, which takes it also when it is stopped (SIGTERM would wait for a SIGCONT)."""
    p, endpoint, _ = start(tmp_path)
    reap.append(p)
    run_id = run_id_of(endpoint)
    os.kill(worker_pid(endpoint, 1), signal.SIGSTOP)
    p.kill()
    p.wait()
    assert_nothing_left(endpoint, run_id)


def test_the_launcher_and_ctl_start_without_torch():
    """l2l-launch and l2l-ctl only start and talk to processes: they must not load torch
    (seconds of CPU per call, on every job start and every status query). Its dtypes and
    shared-memory views load it when first used."""
    code = ("import sys, launch.__main__, launch.ctl; print('torch' in sys.modules); "
            "from protocol.tensors import DTYPES, dtype_of; "
            "print(DTYPES['bfloat16'] is dtype_of('bfloat16'), 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True", "True"]


@pytest.mark.parametrize("timeout, early", [(None, True), ("120", True), ("30", False)])
def test_workers_start_with_the_eps_only_when_they_wait_for_it_long_enough(
        tmp_path, monkeypatch, timeout, early):
    """Workers start beside the EPS (their start-up overlaps its own) when their --eps-timeout
    covers the time the EPS may take to be ready; otherwise once it is ready, as a short
    timeout must not count the EPS's start-up. A launcher's clean-up lets go of its run
    directory's lock: a process that runs job after job (l2l.run in a sweep) keeps no
    descriptor per job."""
    from launch.__main__ import build
    from launch.config import LaunchArgs
    from launch.rundir import withdraw_endpoint
    from protocol import cli

    monkeypatch.chdir(tmp_path)
    args = cli.parse(LaunchArgs, ["--workers", "2", *SMALL,
                                  *(["--eps-timeout", timeout] if timeout else [])], "l2l-launch")
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        launcher = build(args)
        try:
            assert launcher.early_workers is early
        finally:
            launcher.cleanup()
            withdraw_endpoint(launcher.console.log_dir)
            launcher.console.close()
        assert not os.path.exists(launcher.run_dir)
    assert len(os.listdir("/proc/self/fd")) == fds


def test_a_restarted_eps_that_dies_as_it_starts_is_restarted_again(tmp_path):
    """--max-restarts covers an EPS that dies before it is ready on a restart (its checkpoint
    still being read, say), not only one that dies while workers run: here the first EPS dies
    under the workers, the second as it starts, the third serves until the worker is done."""
    from launch import launcher as mod
    from launch.console import Console

    starts, done = tmp_path / "starts", tmp_path / "done"
    eps = [sys.executable, "-c", f"""
import os, sys, time
with open({str(starts)!r}, "a") as f:
    f.write("x")
n = len(open({str(starts)!r}).read())
if n == 2:
    sys.exit(7)  # dies before it is ready
events = os.fdopen(int(sys.argv[-1][3:]), "w")
events.write('{{"event": "ready", "endpoint": "e", "run_id": "r", "pid": %d}}\\n' % os.getpid())
events.flush()
if n == 1:
    time.sleep(0.5)
    sys.exit(9)  # dies while the worker runs
while not os.path.exists({str(done)!r}):
    time.sleep(0.05)
"""]
    worker = [sys.executable, "-c", f"import time; time.sleep(1); open({str(done)!r}, 'w')"]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    console = Console(4, str(tmp_path), quiet=True, out=io.StringIO(), tty=False)
    job = mod.Launcher(eps, [worker], "test-restart", str(run_dir), 4, console,
                       max_restarts=2, early_workers=True)
    assert job.run() == 0, job.failure
    assert starts.read_text() == "xxx"
    assert [r["cause"] for r in job.restarts] == [
        "eps-server exited with status 9 while workers ran",
        "eps-server exited with status 7 before it was ready"]
    job2 = mod.Launcher(eps, [worker], "test-restart", str(run_dir), 4, console,
                        max_restarts=1, early_workers=True)
    starts.unlink()
    done.unlink()
    assert job2.run() == 1  # one restart: the EPS dying again as it starts ends the job
    assert job2.failure == ("eps-server exited with status 7 before it was ready; no restarts "
                            "left (--max-restarts 1)")


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_worker_that_fails_while_the_eps_starts_is_seen_at_once(tmp_path, monkeypatch,
                                                                  restarts):
    """Workers started beside the EPS may fail before it is ready (a bad option, a model they
    cannot build): the job fails then, naming the worker (after its restarts), instead of
    waiting for an EPS that is still loading (here one that never gets ready)."""
    from launch import launcher as mod
    from launch.console import Console

    monkeypatch.setattr(mod, "READY_TIMEOUT", 60.0)
    marker = tmp_path / "starts"
    eps = [sys.executable, "-c", "import time; time.sleep(120)"]
    worker = [sys.executable, "-c", f"open({str(marker)!r}, 'a').write('x'); raise SystemExit(3)"]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    console = Console(4, str(tmp_path), quiet=True, out=io.StringIO(), tty=False)
    job = mod.Launcher(eps, [worker], "test-early", str(run_dir), 4, console,
                       max_restarts=restarts, early_workers=True)
    t0 = time.monotonic()
    assert job.run() == 1
    assert time.monotonic() - t0 < 30  # not the 60 s the EPS is given to get ready
    assert job.failure.startswith("w0 exited with status 3"), job.failure
    assert marker.read_text() == "x" * (1 + restarts)  # restarted as it would be later
    assert all(c.proc.poll() is not None for c in job.children)  # the EPS is stopped too


FAKE_EPS = """
import json, os, sys, time
out = os.fdopen(int(sys.argv[sys.argv.index("--events") + 1][3:]), "w", buffering=1)
say = lambda **ev: out.write(json.dumps(ev) + "\\n")
for done in range(1, 9):  # a load that takes 4 s, saying so every 0.5 s
    time.sleep(0.5)
    say(event="starting", phase="loading", done=done, total=8, patience=0)
if sys.argv[1] == "silent":
    time.sleep(60)
say(event="ready", endpoint="ipc:///x", run_id="r", pid=os.getpid(), step=0)
time.sleep(60)
"""


@pytest.mark.parametrize("then", ["ready", "silent"])
def test_an_eps_that_says_it_is_loading_is_waited_for_while_it_says_so(tmp_path, monkeypatch,
                                                                      then):
    """An EPS that takes longer to start than the launcher's patience (here 2 s) but announces
    its progress (Starting events: joining the boxes, loading a checkpoint) is waited for;
    one that then falls silent fails the job after that patience, saying so."""
    from launch import launcher as mod
    from launch.console import Console

    monkeypatch.setattr(mod, "READY_TIMEOUT", 2.0)
    console = Console(4, str(tmp_path), quiet=True, out=io.StringIO(), tty=False)
    job = mod.Launcher([sys.executable, "-c", FAKE_EPS, then], [], "test-slow-start",
                       str(tmp_path), 4, console)
    try:
        assert job._start_job() == (then == "ready"), job.failure
        if then == "silent":
            assert job.failure == "eps-server not ready, and silent for 2 s"
    finally:
        job.stop_all()


READY_AT = """
import json, os, sys, time
out = os.fdopen(int(sys.argv[sys.argv.index("--events") + 1][3:]), "w", buffering=1)
out.write(json.dumps({"event": "ready", "endpoint": "ipc:///x", "run_id": "r",
                      "pid": os.getpid(), "step": int(sys.argv[1])}) + "\\n")
time.sleep(60)
"""


def test_a_restart_from_an_older_step_than_the_box_s_latest_trims_the_rows_to_it(tmp_path):
    """With several boxes the EPS resumes from the newest checkpoint every box holds, which
    may be older than this box's latest (step 4 here; the EPS says step 2 in its Ready): the
    steps from 2 on are trained again, so their rows go and the restart records step 2."""
    from launch import launcher as mod
    from launch.console import Console

    root = tmp_path / "ck"
    root.mkdir()
    console = Console(4, str(tmp_path), quiet=True, out=io.StringIO(), tty=False)
    job = mod.Launcher([sys.executable, "-c", READY_AT, "2"], [], "test-older", str(tmp_path),
                       8, console, max_restarts=1, checkpoints=str(root), boxes=2)
    (root / "step-00000004").mkdir()
    (root / "step-00000004" / "state.json").write_text('{"step": 4}')
    (root / "latest").write_text("step-00000004")
    job.reports.steps = {s: {} for s in range(6)}  # (no workers: every step is complete)
    job.reports.rows = [{"step": s} for s in range(6)]
    try:
        assert job._restart_job("box 1 was lost")
        assert sorted(job.reports.steps) == [0, 1]
        assert [p["step"] for p in job.reports.rows] == [0, 1]
        assert job.restarts[-1] | {"cause": None} == {
            "rank": None, "cause": None, "detected_after": 0.0, "steps_done": 6,
            "checkpoint_step": 2, "steps_replayed": 4}
    finally:
        job.stop_all()


def test_a_restarted_eps_role_resumes_even_from_a_damaged_checkpoint(tmp_path, monkeypatch):
    """--role eps with a checkpoint under --server-save loads it as --load does (where a damaged
    one is refused, naming the file); a damaged one was taken for none: the run started again
    from step 0 and its first checkpoint pruned the old one. No checkpoint: a fresh start."""
    import eps_server.__main__ as eps_main
    from launch.config import LaunchArgs
    from launch.roles import run_role
    from protocol import cli

    got = []
    monkeypatch.setattr(eps_main, "run", lambda cfg: got.append(cfg.load) or 0)
    ck = tmp_path / "ck"

    def role() -> str:
        args = cli.parse(LaunchArgs, ["--role", "eps", "--runs-dir", str(tmp_path / "runs"),
                                      "--run-id", "r1", "--server-save", str(ck)], "l2l-launch")
        assert run_role(args) == 0
        return got.pop()

    assert role() == ""  # no folder yet
    ck.mkdir()
    assert role() == ""  # an empty one
    (ck / "step-00000010").mkdir()
    (ck / "step-00000010" / "state.json").write_text('{"st')  # truncated
    (ck / "latest").write_text("step-00000010")
    assert role() == str(ck)


def test_the_eps_gets_the_cores_its_workers_leave(monkeypatch):
    """--server-threads 0 (the default): l2l-launch (and each container's --role eps) gives the
    EPS the cores left after every worker's --threads, at least one; an eps-server on its own
    takes the cores it may run on. A number given is kept."""
    from eps_server.config import ServerConfig, available_cores
    from launch import roles
    from launch.config import LaunchArgs
    from protocol import cli

    monkeypatch.setattr(roles, "available_cores", lambda: 16)

    def threads(*argv: str) -> int:
        return roles.server_config(cli.parse(LaunchArgs, list(argv), "l2l-launch"),
                                   "ipc:///tmp/x.sock", "r").threads

    assert threads("--workers", "2", "--threads", "4") == 8
    assert threads("--workers", "1") == 15
    assert threads("--workers", "8", "--threads", "4") == 1
    assert threads("--workers", "2", "--server-threads", "3") == 3
    assert ServerConfig().threads == 0
    assert ServerConfig().math_threads == available_cores() >= 1
    assert ServerConfig(threads=5).math_threads == 5


def test_the_eps_is_given_the_model_options_for_its_checkpoints():
    """What l2l-export builds the model from: an hf: directory as an absolute path (the export
    may run from elsewhere)."""
    from launch import roles
    from launch.config import LaunchArgs
    from protocol import cli

    args = cli.parse(LaunchArgs, ["--model", "hf:rel/dir", "--seq-len", "8"], "l2l-launch")
    record = roles.server_config(args, "ipc:///tmp/x.sock", "r").model_record
    assert record["model"] == "hf:" + os.path.abspath("rel/dir") and record["seq_len"] == 8


def test_a_cgroup_cpu_quota_limits_the_cores(tmp_path, monkeypatch):
    """docker --cpus sets a CPU quota, not an affinity mask: the EPS must not take every core
    of the host."""
    from eps_server import config

    def quota(text: str):
        (tmp_path / "cpu.max").write_text(text)
        return config.cgroup_cpu_quota(str(tmp_path / "cpu.max"))

    assert quota("max 100000\n") is None
    assert quota("250000 100000\n") == 3 and quota("50000 100000\n") == 1
    assert quota("nonsense\n") is None and config.cgroup_cpu_quota(str(tmp_path / "no")) is None
    monkeypatch.setattr(config, "cgroup_cpu_quota", lambda: 1)
    assert config.available_cores() == 1


def test_run_directories_of_launchers_that_are_gone_are_removed(tmp_path, monkeypatch):
    """A killed launcher leaves its private directory; the next one removes it, and only it:
    not one whose launcher lives (it holds its lock), nor one without a lock file."""
    from launch.rundir import LOCK, private_run_dir

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    script = ("import sys; from launch.rundir import private_run_dir; "
              "print(private_run_dir(), flush=True); sys.stdin.read()")
    procs = [subprocess.Popen([sys.executable, "-c", script], env={**ENV, "XDG_RUNTIME_DIR":
                                                                   str(tmp_path)},
                              cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    dead, live = (os.path.basename(p.stdout.readline().strip()) for p in procs)
    procs[0].kill()  # as a SIGKILLed launcher: its directory stays
    procs[0].wait()
    (tmp_path / "l2l-run-making").mkdir()  # no lock file yet
    try:
        assert (tmp_path / dead / LOCK).exists()
        new = os.path.basename(private_run_dir())
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live, "l2l-run-making",
                                                                       new])
    finally:
        procs[1].kill()
        procs[1].wait()


def test_a_worker_role_writes_its_summary_where_summary_json_says(tmp_path, monkeypatch):
    """--role worker: one summary per worker, at --summary-json with {rank} (or -{rank} added
    before its extension), else in the run directory (it was always the run directory)."""
    import worker.__main__ as worker_main
    from launch.config import LaunchArgs
    from launch.roles import run_role
    from protocol import cli

    got = []
    monkeypatch.setattr(worker_main, "run", lambda a: got.append(a.worker.summary_json) or 0)
    runs = tmp_path / "runs"
    for run, flag, want in (("r1", "", str(runs / "r1" / "worker-{rank}.json")),
                            ("", "", str(runs / "{run}" / "worker-{rank}.json")),  # from the EPS
                            ("r1", "s.json", "s-{rank}.json"),
                            ("r1", "s{rank}.json", "s{rank}.json")):
        args = cli.parse(LaunchArgs, ["--role", "worker", "--runs-dir", str(runs),
                                      *(["--run-id", run] if run else []),
                                      *(["--summary-json", flag] if flag else [])],
                         "l2l-launch", "")
        assert run_role(args) == 0 and got.pop() == want


def test_a_worker_summary_path_takes_its_rank_and_the_run_the_eps_names():
    from worker.eps_client import EpsError
    from worker.job import summary_file

    assert summary_file("runs/{run}/worker-{rank}.json", 3, "ab12") == "runs/ab12/worker-3.json"
    for bad in ("../..", "", "a/b"):  # the run id becomes a folder name: never a path
        with pytest.raises(EpsError, match="run id"):
            summary_file("runs/{run}/w.json", 0, bad)


def test_quiet_still_says_why_a_child_failed(tmp_path):
    """--quiet hides the children's log lines; a failure's own reason is shown with it."""
    bad = tmp_path / "bad.tsv"
    bad.write_text("text\tlabel\na\t1\n")
    p, s, endpoint = launch(tmp_path, "--workers", "1", *SMALL, "--steps", "2", "--data",
                            str(bad), timeout=120)
    assert p.returncode == 1 and not s["ok"]
    assert "l2l-launch: failed: w0 exited with status 1" in p.stderr
    assert "[w0]" in p.stderr and "needs the model's tokenizer" in p.stderr, p.stderr


@pytest.mark.parametrize("exited", [True, False])
def test_a_worker_the_eps_saw_exit_is_reported_by_its_exit_status(tmp_path, capsys, exited):
    """The EPS declares a worker dead when its process is gone, which a SIGKILLed process is
    (its main thread a zombie) while its other threads still exit: the launcher waits for it
    and names its exit status, instead of "declared dead ... without a message; killing it".
    A hung worker (``exited`` False: still running) is killed and named as hung."""
    from launch import launcher as mod
    from launch.children import Child
    from launch.console import Console
    from protocol.events import PeerLost

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    console = Console(4, str(tmp_path), out=io.StringIO(), tty=False)
    job = mod.Launcher([], [[sys.executable, "-c", "pass"]], "test-exit", str(run_dir), 4,
                       console, max_restarts=1)
    dying = "sleep 0.5; kill -9 $$" if exited else "sleep 60"
    proc = subprocess.Popen(["sh", "-c", dying], start_new_session=True)
    job.workers[0] = Child("w0", proc)
    job.children.append(job.workers[0])
    try:
        job._lost = [PeerLost(rank=0, pid=proc.pid, silent=0.3, exited=exited)]
        assert job._check_workers()
        [restart] = job.restarts
        said = capsys.readouterr().err  # the launcher's notes
        if exited:
            assert restart["cause"] == "was killed by SIGKILL", restart
            assert "declared dead" not in said, said
        else:
            assert restart["cause"] == "hung: declared dead after 0.3 s without a message"
            assert "declared dead by the EPS after 0.3 s without a message; killing it" in said
        assert "w0 was killed by SIGKILL; restarting rank 0" in said, said
    finally:
        job.stop_all()
        console.close()


def test_a_checkpoint_of_another_model_fails_the_job_without_spending_restarts(tmp_path):
    """Each worker the EPS refuses as another model (manifest_mismatch) exited with status 1,
    and --max-restarts 3 started each 3 times more to be refused again."""
    p, _, _ = launch(tmp_path, "--workers", "1", "--steps", "1", *SMALL, "--server-save", "ck")
    assert p.returncode == 0, p.stderr
    other = [("64" if a == "32" else a) for a in SMALL]  # --hidden 64
    p, summary, _ = launch(tmp_path, "--workers", "2", "--steps", "2", *other, "--load", "ck",
                           "--max-restarts", "3")
    assert p.returncode != 0 and "manifest_mismatch" in p.stderr, p.stderr
    assert "restarting" not in p.stderr and not summary["restarts"], p.stderr


def test_a_missing_model_directory_or_data_file_is_refused_before_anything_starts(tmp_path):
    """Each worker found a wrong --model hf:PATH or --data FILE after its start-up (6-10 s),
    and each said so: the launcher says it once, before it starts anything, exit status 2."""
    (tmp_path / "model").mkdir()
    (tmp_path / "sharded").mkdir()  # (a copy not finished: one of its two shards is there)
    (tmp_path / "sharded" / "config.json").write_text("{}")
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors",
                        "b": "model-00002-of-00002.safetensors"}}))
    (tmp_path / "sharded" / "model-00001-of-00002.safetensors").write_bytes(b"")
    for model, said in (("hf:no/such", "--model hf:no/such: no such directory"),
                        ("hf:model", "--model hf:model: no config.json in it"),
                        ("hf:sharded", "--model hf:sharded: its model.safetensors.index.json "
                         "lists model-00002-of-00002.safetensors, not there")):
        p = subprocess.run([*LAUNCH, "--workers", "2", "--model", model, "--data", "none.txt",
                            *SMALL], env=ENV, cwd=tmp_path, capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == REFUSED, p.stderr
        lines = p.stderr.splitlines()
        assert len(lines) == 2 and lines[0].startswith(f"l2l-launch: {said}"), lines
        assert lines[1] == "l2l-launch: --data none.txt: no such file"
    assert not (tmp_path / "runs").exists()  # no job was made


def test_the_plan_lists_the_tensors_freeze_names_and_refuses_as_a_job_would(tmp_path):
    """--freeze's errors point at --plan for the tensors' names, which it did not list; a
    mistake in a --plan was a traceback where the job's start says it in a line."""
    model = ["--model", "gpt", "--layers", "3", "--hidden", "32", "--heads", "2"]
    p = subprocess.run([*LAUNCH, *model, "--tie-embeddings", "--freeze", "pre.*", "--plan",
                        "--data", "/data/in/train.bin"],  # (where a container will see it)
                       env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert "  blocks.0 .. blocks.2 (3 layers alike)  [decoder]" in lines
    assert "    tok.weight  (128, 32)  frozen" in lines
    assert "    out.weight  (128, 32)  frozen, tied to pre.tok.weight" in lines
    assert lines[-1].startswith("L2L_SHM_SIZE=")
    for wrong, said in (([*model, "--freeze", "zz*"], "--freeze 'zz*' matches no tensor"),
                        (["--model", "hf:no/such"], "--model hf:no/such: no such directory")):
        p = subprocess.run([*LAUNCH, *wrong, "--plan"], env=ENV, cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == REFUSED and p.stderr.startswith(f"l2l-launch: {said}"), p.stderr
        assert "Traceback" not in p.stderr and p.stdout == ""


def test_a_failed_job_names_the_checkpoint_to_go_on_from(tmp_path, reap):
    """The EPS killed, no restarts: the launcher's failure line says which checkpoint to
    --load."""
    endpoint = f"ipc://{tmp_path}/eps.sock"
    p = subprocess.Popen([*LAUNCH, "--endpoint", endpoint, "--steps", "100000", *SMALL,
                          "--server-save", "ckpt", "--checkpoint-every", "1"], env=ENV,
                         cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    reap.append(p)
    deadline = time.monotonic() + 120
    while not (tmp_path / "ckpt" / "latest").exists():
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.1)
    [eps] = [pid for pid in processes_with(endpoint) if "eps_server" in open(
        f"/proc/{pid}/cmdline", "rb").read().decode().split("\0")]
    os.kill(eps, signal.SIGKILL)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1
    [line] = [x for x in err.splitlines() if x.startswith("l2l-launch: failed:")]
    assert line.startswith("l2l-launch: failed: eps-server was killed by SIGKILL"), err
    assert f"go on from there with --load {tmp_path / 'ckpt'}" in line, line
    # a checkpoint the EPS refuses to load (damaged) is not the one to go on from
    for f in (tmp_path / "ckpt").glob("step-*/master*.safetensors"):
        os.chmod(f, 0o600)
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    r = subprocess.run([*LAUNCH, "--endpoint", endpoint, "--steps", "100000", *SMALL,
                        "--server-save", "ckpt", "--load", "ckpt"], env=ENV, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "checksum" in r.stderr, r.stderr
    assert "go on from there" not in r.stderr, r.stderr
