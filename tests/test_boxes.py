"""A job over several boxes (``--nodes``): here the "boxes" are l2l-launch processes on
loopback, each with its own EPS, workers, shared memory and socket, joined by a real gloo
group. 2 boxes x 1 worker train as 1 box x 2 workers do; replicas are compared across boxes;
a box that dies fails the others within --box-timeout, saying so."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time

import pytest
from safetensors.torch import load_file

from eps_server.boxes import BoxLost, Sequence
from eps_server.config import BoxesConfig

from .baseline import assert_close
from .helpers import ENV, SMALL, free_port
from .test_launch import LAUNCH, assert_nothing_left, processes_with

STEPS = 6
JOB = [*SMALL, "--steps", str(STEPS), "--lr", "3e-3", "--box-check-every", "2"]


def boxes(tmp_path, n: int, *extra: str, per_box=lambda r: ()) -> list[subprocess.Popen]:
    """Start ``n`` boxes of one worker each (box 0 saves the model); their launchers."""
    port = str(free_port())
    procs = []
    for r in range(n):
        d = tmp_path / f"box{r}"
        d.mkdir(mode=0o700)  # it holds the box's ipc socket
        procs.append(subprocess.Popen(
            [*LAUNCH, "--endpoint", f"ipc://{d}/eps.sock", "--summary-json", str(d / "s.json"),
             "--workers", "1", "--nodes", str(n), "--node-rank", str(r), "--master-port", port,
             *JOB, "--save", str(d / "m.st"), *extra, *per_box(r)],
            env=ENV, cwd=d, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True))
    return procs


def finish(procs, timeout=240) -> list[tuple[int, str]]:
    out = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            out.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return out


@pytest.fixture(scope="module")
def one_box(tmp_path_factory):
    """1 box x n workers, the reference."""
    done = {}

    def get(n: int, *extra: str) -> dict:
        if (n, extra) not in done:
            tmp = tmp_path_factory.mktemp(f"one{n}")
            p = subprocess.run([*LAUNCH, "--workers", str(n), *JOB, *extra, "--save",
                                str(tmp / "m.st")], env=ENV, cwd=tmp, capture_output=True,
                               text=True, timeout=240)
            assert p.returncode == 0, p.stderr
            done[n, extra] = load_file(str(tmp / "m.st"))
        return done[n, extra]

    return get


CLIP = ("--clip-norm", "0.05")


@pytest.mark.parametrize("mode,n,extra", [
    pytest.param("replicate", 2, (), id="replicate-2"), pytest.param("shard", 2, (), id="shard-2"),
    pytest.param("replicate", 3, (), marks=pytest.mark.slow, id="replicate-3"),
    pytest.param("shard", 3, (), marks=pytest.mark.slow, id="shard-3"),
    pytest.param("shard", 3, CLIP, marks=pytest.mark.slow, id="shard-3-clip")])
def test_n_boxes_of_one_worker_train_as_one_box_of_n(tmp_path, one_box, mode, n, extra):
    """6 AdamW steps, dropout on: the same global micro-batches, the same sum of gradients (in
    fp32, rank order, here bitwise; the tolerance is FP32's 1e-5 + 1e-4 rel), replicas compared
    every 2 steps across the boxes. ``shard``: each box updates its third or half of every
    layer (reduce-scatter, all-gather); the served copies are compared. With global-norm
    clipping, layers are updated speculatively or held, and redone, undone or applied once the
    step is decided: each such job gathers its layer again, in one order on every box."""
    results = finish(boxes(tmp_path, n, "--eps-mode", mode, *extra))
    for r, (code, err) in enumerate(results):
        assert code == 0, f"box {r}: {err}"
    got = load_file(str(tmp_path / "box0" / "m.st"))
    assert_close(got, one_box(n, *extra), atol=1e-5, rtol=1e-4)
    for r in range(n):
        s = json.loads((tmp_path / f"box{r}" / "s.json").read_text())
        assert s["ok"] and s["steps"] == STEPS and s["world_size"] == 1
        eps = (tmp_path / f"box{r}" / "runs" / s["run_id"] / "eps.log").read_text()
        assert eps.count(f"the {n} boxes' replicas are identical") == 3, eps  # steps 0, 2, 4
        assert_nothing_left(f"ipc://{tmp_path}/box{r}/eps.sock", s["run_id"])
    assert not (tmp_path / "box1" / "m.st").exists()  # box 0 writes --save


def test_replicas_that_differ_stop_the_job_on_every_box(tmp_path):
    """Box 1's workers start the model from other weights (--init-from a file of its own, a
    path the join does not compare): the first comparison (step 0) finds the replicas
    different, and both boxes fail saying so."""
    from safetensors.torch import save_file

    from launch.config import LaunchArgs
    from protocol import cli
    from worker.models import build_model

    for r in range(2):
        model = build_model(cli.parse(LaunchArgs, [*JOB, "--seed", str(5 + r)], "t").model)
        save_file({k: v.contiguous() for k, v in model.assemble().state_dict().items()},
                  str(tmp_path / f"init{r}.safetensors"))
    results = finish(boxes(tmp_path, 2, per_box=lambda r: (
        "--init-from", str(tmp_path / f"init{r}.safetensors"))))
    for r, (code, err) in enumerate(results):
        assert code == 1, f"box {r}: {err}"
        s = json.loads((tmp_path / f"box{r}" / "s.json").read_text())
        eps = (tmp_path / f"box{r}" / "runs" / s["run_id"] / "eps.log").read_text()
        assert "the replicas differ at step 0 in layers" in eps, eps


@pytest.mark.parametrize("mode, option, said", [
    ("shard", ("--lr", "1e-1"), "optimizer.lr 0.1 vs 0.003"),  # each shard its own rate
    ("replicate", ("--micro-batches", "3"), "job.micro_batches 3 vs 2")])  # another batch
def test_boxes_started_with_other_settings_are_refused_at_the_join(tmp_path, mode, option,
                                                                   said):
    """Box 1 given another learning rate in shard mode trained silently (each box updated its
    shard with its own; the gathered served copies agreed), one with more micro-batches
    counted a global batch of its own: now both boxes refuse at the join, naming it."""
    results = finish(boxes(tmp_path, 2, "--eps-mode", mode, per_box=lambda r: option * r))
    for r, (code, err) in enumerate(results):
        assert code != 0 and said in err and "must be started with the same" in err, err
        assert "Traceback" not in err and "step 1/" not in err, err


def test_shard_boxes_that_do_not_share_their_checkpoint_folder_are_refused(tmp_path):
    """Each box given a --server-save of its own (no shared file system) failed every
    checkpoint and the job exited 0 without one: now refused at the join, on every box."""
    results = finish(boxes(tmp_path, 2, "--eps-mode", "shard", "--checkpoint-every", "2",
                           per_box=lambda r: ("--server-save", str(tmp_path / f"ck{r}"))))
    for r, (code, err) in enumerate(results):
        assert code != 0 and "box(es) [1] do not see box 0's folder" in err, err
    assert os.listdir(tmp_path / "ck0") == [".lock"]  # box 0's marker is gone


def test_a_dead_box_fails_the_others_within_the_timeout(tmp_path):
    """Box 1's EPS is killed once training runs: box 0's next reduction fails (gloo sees
    the connection gone, or waits --box-timeout at most) and box 0's job fails saying so,
    well within the bound; nothing of it is left behind."""
    procs = boxes(tmp_path, 2, "--box-timeout", "10", "--steps", "400", "--log-every", "1")
    try:
        steps = 0
        for line in procs[0].stdout:  # box 0's progress: one line a step
            steps += line.startswith("step ")
            if steps >= 3:
                break
        endpoint = f"ipc://{tmp_path}/box1/eps.sock"
        [eps] = [pid for pid in processes_with(endpoint) if b"eps_server" in
                 open(f"/proc/{pid}/cmdline", "rb").read()]
        t0 = time.monotonic()
        os.kill(eps, signal.SIGKILL)
        code, err = finish(procs[:1])[0]
        took = time.monotonic() - t0
    finally:
        finish(procs)
    assert code == 1, err
    assert took < 10 + 30, took  # the bound, and the launcher's stop of its children
    s = json.loads((tmp_path / "box0" / "s.json").read_text())
    eps = (tmp_path / "box0" / "runs" / s["run_id"] / "eps.log").read_text()
    assert "boxes failed (a box died or is cut off?)" in eps, eps
    assert_nothing_left(f"ipc://{tmp_path}/box0/eps.sock", s["run_id"])


def test_the_boxes_group_on_a_routable_address_needs_insecure(tmp_path):
    p = subprocess.run([*LAUNCH, "--workers", "1", *JOB, "--nodes", "2", "--master-addr",
                        "10.1.2.3"], env=ENV, cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "gloo group has no authentication" in p.stderr, p.stderr
    # so does an env rendezvous's MASTER_ADDR (the option went unused there, and was checked)
    from eps_server.config import ServerConfig

    env = {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29611"}
    with pytest.MonkeyPatch.context() as m:
        for k, v in env.items():
            m.setenv(k, v)
        with pytest.raises(ValueError, match="--master-addr 10.1.2.3 .not loopback."):
            ServerConfig(boxes=BoxesConfig(nodes=2, rendezvous="env"))
        boxes = ServerConfig(boxes=BoxesConfig(nodes=2, rendezvous="env"), insecure=True).boxes
        assert (boxes.master_addr, boxes.master_port) == ("10.1.2.3", 29611)


def test_the_sequence_puts_every_box_s_collectives_in_one_order():
    """Steps ascending, layers descending within a step; a skipped layer is passed over; a
    turn that never comes times out; a failure wakes every waiter."""
    seq = Sequence(3, lambda: 4)
    order = []

    def engine(key):
        seq.wait_turn(key, 10.0)
        order.append(key)
        seq.done(key)

    threads = [threading.Thread(target=engine, args=(k,)) for k in
               [(5, 0), (4, 0), (5, 2), (4, 2)]]  # started out of order; (4, 1) is skipped
    for t in threads:
        t.start()
    time.sleep(0.1)
    seq.skip((4, 1))
    seq.skip((5, 1))
    for t in threads:
        t.join(10)
    assert order == [(4, 2), (4, 0), (5, 2), (5, 0)] and seq.next == (6, 2)
    with pytest.raises(BoxLost, match="waited 0.1 s for its turn"):
        seq.wait_turn((6, 1), 0.1)
    seq.fail(RuntimeError("gone"))
    with pytest.raises(BoxLost, match="an earlier cross-box reduction failed: gone"):
        seq.wait_turn((6, 2), 1.0)


def test_replicas_are_compared_where_every_box_has_the_layer_at_the_step():
    """A layer that LayerDrop dropped in step t may still be taking its step t-1 update on one
    box while the boxes compare: where a box has it at an older version its checksum is not
    read (0) and the layer is not compared; every other layer is, and a difference there is
    found."""
    import torch

    from eps_server.boxes import differing

    def row(sums, ready):
        return torch.tensor([7, *sums, *ready], dtype=torch.int64)

    same = [row([11, 22, 33], [1, 1, 1]), row([11, 22, 33], [1, 1, 1])]
    assert differing(same, 3) == []
    mid_update = [row([11, 22, 33], [1, 1, 1]), row([11, 0, 33], [1, 0, 1])]
    assert differing(mid_update, 3) == []
    assert differing([row([11, 22, 33], [1, 1, 1]), row([11, 0, 34], [1, 0, 1]),
                      row([11, 22, 33], [1, 1, 1])], 3) == [2]
    assert differing([row([12, 22, 33], [1, 1, 1]), row([11, 22, 33], [1, 1, 1])], 3) == [0]


@pytest.mark.slow
def test_under_torchrun_each_box_runs_one_l2l_launch(tmp_path, one_box):
    """torchrun --nnodes 2 --nproc-per-node 1 on each "box" runs l2l-launch, which takes the
    boxes from torchrun's variables and joins through its store: the same weights again."""
    import shutil
    import sys

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("no torchrun beside this Python")
    port, procs = str(free_port()), []
    for r in range(2):
        d = tmp_path / f"box{r}"
        d.mkdir(mode=0o700)
        procs.append(subprocess.Popen(
            [torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(r),
             "--master-addr", "127.0.0.1", "--master-port", port, "-m", "launch", "--quiet",
             "--workers", "1", *JOB, *(["--save", str(d / "m.st")] if r == 0 else [])],
            env=ENV, cwd=d, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True))
    for r, (code, err) in enumerate(finish(procs)):
        assert code == 0, f"box {r}: {err}"
    assert_close(load_file(str(tmp_path / "box0" / "m.st")), one_box(2), atol=1e-5, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["replicate", "shard"])
def test_a_two_box_checkpoint_resumes_on_one_box_and_on_three(tmp_path, mode):
    """Global batch 6 micro-batches (global rank g runs [g*u, (g+1)*u), so every split runs the
    same ones): 2 boxes x u=3 train 4 steps and checkpoint (replicate: a full replica per box;
    shard: each box its half, into one shared folder); the run resumes from that checkpoint on
    1 box (u=6) and on 3 boxes (u=2, the same mode) to step 8, and both end as 1 box x u=6
    trained 8 steps without a stop does."""
    job = [*JOB, "--micro-batches"]
    ref = tmp_path / "ref"
    ref.mkdir()
    p = subprocess.run([*LAUNCH, "--workers", "1", *job, "6", "--steps", "8", "--save",
                        str(ref / "m.st")], env=ENV, cwd=ref, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stderr
    want = load_file(str(ref / "m.st"))
    first = tmp_path / "first"
    first.mkdir()
    ck = str(first / "ck" if mode == "shard" else first / "box0" / "ck")
    for r, (code, err) in enumerate(finish(boxes(
            first, 2, "--micro-batches", "3", "--steps", "4", "--eps-mode", mode,
            "--server-save", ck if mode == "shard" else "ck"))):
        assert code == 0, f"box {r}: {err}"
    state = json.loads((first / ck / "step-00000004" / "state.json").read_text())
    assert state.get("shards", 0) == (2 if mode == "shard" else 0), state
    one = tmp_path / "one"
    one.mkdir()
    p = subprocess.run([*LAUNCH, "--workers", "1", *job, "6", "--steps", "8", "--load", ck,
                        "--save", str(one / "m.st")], env=ENV, cwd=one, capture_output=True,
                       text=True, timeout=240)
    assert p.returncode == 0, p.stderr
    assert_close(load_file(str(one / "m.st")), want, atol=1e-5, rtol=1e-4)
    three = tmp_path / "three"
    three.mkdir()
    for r, (code, err) in enumerate(finish(boxes(three, 3, "--micro-batches", "2", "--steps",
                                                 "8", "--load", ck, "--eps-mode", mode))):
        assert code == 0, f"box {r}: {err}"
    assert_close(load_file(str(three / "box0" / "m.st")), want, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["replicate", "shard"])
def test_with_restarts_a_dead_box_restarts_every_box_from_the_last_checkpoint(tmp_path,
                                                                              one_box, mode):
    """Checkpoints every 2 steps (replicate: each box its own; shard: together, one shared
    folder); box 1's EPS is killed once there is one: box 0's EPS exits (status 3, "another
    box was lost"), each launcher restarts its job from the last checkpoint, the boxes meet
    again and the run ends as the failure-free one."""
    from protocol.checkpoints import latest

    roots = [str(tmp_path / "ck" if mode == "shard" else tmp_path / f"box{r}" / "ck")
             for r in range(2)]
    procs = boxes(tmp_path, 2, "--max-restarts", "1", "--checkpoint-every", "2", "--steps",
                  "8", "--eps-mode", mode, per_box=lambda r: ("--server-save", roots[r]))
    try:
        deadline = time.monotonic() + 120
        while True:
            found = [latest(root) for root in roots]
            if all(found) and found[0][1] == found[1][1] < 8:
                break
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.01)
        endpoint = f"ipc://{tmp_path}/box1/eps.sock"
        [eps] = [pid for pid in processes_with(endpoint) if b"eps_server" in
                 open(f"/proc/{pid}/cmdline", "rb").read()]
        os.kill(eps, signal.SIGKILL)
        results = finish(procs)
    finally:
        finish(procs)
    for r, (code, err) in enumerate(results):
        assert code == 0, f"box {r}: {err}"
        s = json.loads((tmp_path / f"box{r}" / "s.json").read_text())
        [restart] = s["restarts"]
        assert restart["checkpoint_step"] == found[0][1], restart
        cause = "SIGKILL" if r == 1 else "exited with status 3"
        assert cause in restart["cause"], restart
    assert_close(load_file(str(tmp_path / "box0" / "m.st")), one_box(2, "--steps", "8"),
                 atol=1e-5, rtol=1e-4)


def test_shard_mode_in_bf16_saves_through_the_final_checkpoint(tmp_path):
    """No box holds the whole fp32 master to serve: --save needs --server-save (refused at
    once without it)."""
    p = subprocess.run([*LAUNCH, "--workers", "1", *JOB, "--nodes", "2", "--eps-mode", "shard",
                        "--precision", "bf16", "--save", str(tmp_path / "m.st")], env=ENV,
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "needs --server-save" in p.stderr, p.stderr


@pytest.mark.slow
def test_shard_mode_in_bf16_exports_the_fp32_master_as_one_box_trains_it(tmp_path, one_box):
    """bf16 compute, fp32 master in halves: box 0's launcher writes --save from the boxes'
    final checkpoint, and it is what 1 box x 2 workers in bf16 trains (the same sums, the
    same kernels over each element)."""
    results = finish(boxes(tmp_path, 2, "--eps-mode", "shard", "--precision", "bf16",
                           "--server-save", str(tmp_path / "ck")))
    for r, (code, err) in enumerate(results):
        assert code == 0, f"box {r}: {err}"
    assert_close(load_file(str(tmp_path / "box0" / "m.st")), one_box(2, "--precision", "bf16"),
                 atol=1e-5, rtol=1e-4)


def test_boxes_whose_latest_checkpoints_differ_resume_from_the_newest_they_all_hold(tmp_path,
                                                                                   one_box):
    """Box 1's checkpoint of step 4 is gone (its disk was full, or it was cut off while box 0
    wrote): loaded again, both boxes resume from step 2, the newest step both hold, and end as
    the failure-free run. Boxes that hold no step in common are refused at once, each saying
    what every box holds (the EPS's refusal: no restart could help)."""
    first = tmp_path / "first"
    first.mkdir()
    for r, (code, err) in enumerate(finish(boxes(first, 2, "--steps", "4", "--server-save",
                                                 "ck", "--checkpoint-every", "2",
                                                 "--keep-checkpoints", "2"))):
        assert code == 0, f"box {r}: {err}"
    ck = [first / f"box{r}" / "ck" for r in range(2)]
    assert {p.name for p in ck[1].glob("step-*")} == {"step-00000002", "step-00000004"}
    for p in ck[1].glob("step-00000004*"):
        shutil.rmtree(p)
    (ck[1] / "latest").write_text("step-00000002")
    again = tmp_path / "again"
    again.mkdir()
    for r, (code, err) in enumerate(finish(boxes(again, 2, per_box=lambda r: (
            "--load", str(ck[r]))))):
        assert code == 0, f"box {r}: {err}"
    log = next((again / "box0" / "runs").glob("*/eps.log")).read_text()
    assert "box 0: resuming from step 2, the newest checkpoint every box holds" in log, log
    assert_close(load_file(str(again / "box0" / "m.st")), one_box(2), atol=1e-5, rtol=1e-4)

    shutil.rmtree(ck[0] / "step-00000002")  # box 0 now holds step 4 only, box 1 step 2
    refused = tmp_path / "refused"
    refused.mkdir()
    for r, (code, err) in enumerate(finish(boxes(refused, 2, per_box=lambda r: (
            "--load", str(ck[r]))))):
        assert code == 1 and "eps-server exited with status 2 before it was ready" in err, err
        assert "the boxes hold no checkpoint of one step to resume from together (box 0: " \
            "steps [4]; box 1: steps [2])" in err, err
    missing = tmp_path / "missing"
    missing.mkdir()  # a box that cannot read its --load still answers the others at once
    out = finish(boxes(missing, 2, per_box=lambda r: ("--load", str(ck[0] if r == 0 else
                                                                  tmp_path / "nowhere"))))
    assert "(box 0: steps [4]; box 1: steps [])" in out[0][1], out[0][1]
    assert f"--load {tmp_path / 'nowhere'}: " in out[1][1], out[1][1]
    assert all(code == 1 and "status 2 before it was ready" in err for code, err in out), out


def test_one_box_of_several_refuses_a_save_or_a_setting_of_its_own(tmp_path):
    """l2l-ctl save and set reach one EPS: with several boxes a save would park this box's
    engines while the others wait in their collectives, and a setting would make the boxes
    update differently (replicas that differ; in shard mode, chunks updated unlike each other).
    Both are refused, saying what to do instead; one box alone takes them."""
    from eps_server.config import BoxesConfig
    from protocol.messages import Save, SetHyper

    from .test_core import Harness, error

    for nodes in (2, 1):  # (no collective runs here: a core of box 0 needs no group for this)
        h = Harness(1, boxes=BoxesConfig(nodes=nodes))
        try:
            h.send(0, SetHyper(req_id=3, changes={"lr": 0.125}))  # before the model: the lobby
            if nodes > 1:
                assert "cannot change hyperparameters on one box" in error(h.take(0, 3)).message
            h.bootstrap()
            h.send(0, Save(req_id=1, path=str(tmp_path / f"ck{nodes}")))
            h.send(0, SetHyper(req_id=2, changes={"lr": 0.25}))
            if nodes == 1:
                assert h.take(0, 2).msg.optimizer["lr"] == 0.25
                continue
            said = error(h.take(0, 1)).message
            assert said == ("a job over 2 boxes cannot save on one box: its boxes checkpoint "
                            "together (--checkpoint-every, and at exit)"), said
            said = error(h.take(0, 2)).message
            assert said.startswith("a job over 2 boxes cannot change hyperparameters on one box"
                                   ": restart it from a checkpoint"), said
        finally:
            h.close()
