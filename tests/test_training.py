"""End to end with real eps-server and l2l-worker processes: L2L equals plain PyTorch training,
is independent of how the minibatch is split, learns, and resumes exactly from a checkpoint."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from protocol.checkpoints import resolve
from protocol.events import ServerStats, read_events
from worker.config import ModelConfig
from worker.models import build_model

from .baseline import assert_close, train_resident
from .helpers import SMALL

STEPS = 5
# The same small model as helpers.SMALL, as a ModelConfig for the in-process baseline.
SMALL_CFG = dict(layers=2, hidden=32, heads=2, seq_len=16, vocab=64, dropout=0.1)


def l2l(cluster, tmp_path, *, model: str, workers: int, micro_batches: int, steps: int = STEPS,
        extra=(), server=()) -> dict:
    out = tmp_path / "model.safetensors"
    cluster.run_job(workers, *SMALL, "--model", model, "--steps", str(steps),
                    "--micro-batches", str(micro_batches), "--save", str(out), *extra,
                    server_args=("--lr", "1e-3", *server))
    assert not cluster.leftover_regions()
    return load_file(str(out))


@pytest.mark.parametrize("model, workers, transport", [
    # Slow, as the default set has them: one worker against plain training in
    # test_split_does_not_matter (1 worker x 4 micro-batches), GPT in
    # test_layer_drop_through_the_eps, frames in test_other_layered_networks_equal_plain_pytorch.
    pytest.param("bert", 1, "shm", marks=pytest.mark.slow), ("bert", 2, "shm"),
    pytest.param("gpt", 2, "frames", marks=pytest.mark.slow)])
def test_l2l_equals_plain_pytorch(cluster, tmp_path, model, workers, transport):
    """FP32 L2L (dropout on, AdamW, u=2, 5 steps) ends with the weights of plain training of
    the assembled model with gradient accumulation over the same micro-batches: every
    parameter within 1e-5 absolute + 1e-4 relative (the difference is the order of additions
    across workers and the fused vs. for-each AdamW kernel)."""
    got = l2l(cluster, tmp_path, model=model, workers=workers, micro_batches=2,
              extra=("--transport", transport))
    want = train_resident(ModelConfig(model=model, **SMALL_CFG), steps=STEPS,
                          global_micro_batches=2 * workers, batch_size=4, lr=1e-3)
    assert_close(got, want)


def test_the_eps_threads_do_not_change_a_bit(cluster, tmp_path):
    """Three EPS threads (three engines sharing them, each job's share re-taken between the
    optimizer's chunks) end with the weights of one, bit for bit, with per-layer clipping:
    with one worker no order of additions can differ."""
    common = ("--clip-norm", "0.5")
    a = l2l(cluster, tmp_path, model="bert", workers=1, micro_batches=2,
            server=(*common, "--server-threads", "3"))
    cluster.close()
    b = l2l(cluster, tmp_path, model="bert", workers=1, micro_batches=2, server=common)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("update", ["eager", "deferred"])
def test_global_clipping_equals_clip_grad_norm(cluster, tmp_path, update):
    """--clip-norm clips the global norm as torch.nn.utils.clip_grad_norm_ does, in both update
    modes, 2 workers, AdamW, dropout on: the clip is set between the steps' norms, so some
    steps clip and some do not (eager then takes its speculative updates back and redoes
    them, or holds the next step); weights within 1e-5 + 1e-4 relative of plain training.
    The EPS's final checkpoint holds the last step, as test_final_checkpoint_holds_the_last_step
    (slow) checks without clipping."""
    norms: list[float] = []
    train_resident(ModelConfig(model="bert", **SMALL_CFG), steps=STEPS, global_micro_batches=4,
                   batch_size=4, lr=1e-3, clip_norm=1e9, norms=norms)
    clip = sorted(norms)[len(norms) // 2]  # the median: clips about half the steps
    ckpt = tmp_path / "ckpt"
    got = l2l(cluster, tmp_path, model="bert", workers=2, micro_batches=2,
              server=("--clip-norm", str(clip), "--update", update, "--server-save", str(ckpt)))
    want = train_resident(ModelConfig(model="bert", **SMALL_CFG), steps=STEPS,
                          global_micro_batches=4, batch_size=4, lr=1e-3, clip_norm=clip)
    assert_close(got, want)
    stats = [e for e in read_events(str(tmp_path / "eps-0.events"))
             if isinstance(e, ServerStats)][-1].stats
    assert 0 < stats["clipped_steps"] < STEPS
    assert (stats["rollbacks"] > 0) == (update == "eager")
    state = json.loads(open(os.path.join(resolve(str(ckpt)), "state.json")).read())
    assert state["step"] == STEPS and set(state["versions"]) == {STEPS}
    assert "mid-step" not in cluster.log(cluster.server)


def test_split_does_not_matter(cluster, tmp_path):
    """2 workers x 2 micro-batches end where 1 worker x 4 micro-batches does, and where plain
    training does; and SGD with momentum is served as well."""
    sgd = ("--optimizer", "sgd", "--momentum", "0.9")
    a = l2l(cluster, tmp_path, model="bert", workers=2, micro_batches=2, server=sgd,
            extra=("--summary-json", str(tmp_path / "a{rank}.json")))
    cluster.close()
    b = l2l(cluster, tmp_path, model="bert", workers=1, micro_batches=4, server=sgd,
            extra=("--summary-json", str(tmp_path / "b{rank}.json")))
    want = train_resident(ModelConfig(model="bert", **SMALL_CFG), steps=STEPS,
                          global_micro_batches=4, batch_size=4, lr=1e-3, optimizer="sgd",
                          momentum=0.9)
    assert_close(a, b)
    assert_close(a, want)
    # Each worker's summary (as its status and metrics) has its own mean loss: weighted by
    # its loss terms, the two workers' make the one worker's (the whole minibatch's) loss.
    two = [json.loads((tmp_path / f"a{r}.json").read_text()) for r in (0, 1)]
    one = json.loads((tmp_path / "b0.json").read_text())
    for t, loss in enumerate(one["losses"]):
        own = sum(w["losses"][t] * w["counts"][t] for w in two) / sum(w["counts"][t]
                                                                        for w in two)
        assert own == pytest.approx(loss, rel=1e-5)


def test_resume_from_a_scheduled_checkpoint_reproduces_an_uninterrupted_run(cluster,
                                                                            tmp_path):
    """6 steps checkpointed every 3 (two kept): step 6's is not written again at exit, and the
    checkpoints change nothing (the run equals plain PyTorch training). A new server resumed
    from step 3's checkpoint trains to 6 and equals the uninterrupted run (data and dropout are
    functions of the step); one resumed from the latest (step 6's) and stopped before another
    step (a restarted job, say) writes nothing again."""
    ckpt = tmp_path / "ckpt"
    kept = ["step-00000003", "step-00000006"]
    straight = tmp_path / "straight.safetensors"
    cluster.run_job(1, *SMALL, "--steps", "6", "--save", str(straight), server_args=(
        "--server-save", str(ckpt), "--checkpoint-every", "3", "--keep-checkpoints", "2"))
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == kept
    assert "step 6 is saved in" in cluster.log(cluster.server)
    assert json.loads((ckpt / kept[0] / "state.json").read_text())["step"] == 3
    assert_close(load_file(str(straight)), train_resident(
        ModelConfig(model="bert", **SMALL_CFG), steps=6, global_micro_batches=2, batch_size=4))
    cluster.close()
    resumed = tmp_path / "resumed.safetensors"
    cluster.run_job(1, *SMALL, "--steps", "6", "--save", str(resumed),
                    server_args=("--load", str(ckpt / kept[0])))
    assert "at step 3" in cluster.log(cluster.procs[-1])
    a, b = load_file(str(resumed)), load_file(str(straight))
    assert all((a[k] == b[k]).all() for k in a), "resumed run differs from the straight run"
    cluster.close()
    cluster.run_job(1, *SMALL, "--steps", "6", server_args=(
        "--load", str(ckpt), "--server-save", str(ckpt), "--keep-checkpoints", "2"))
    assert "at step 6" in cluster.log(cluster.procs[-1])
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == kept
    assert "step 6 is saved in" in cluster.log(cluster.server)


@pytest.mark.slow
def test_l2l_equals_plain_pytorch_four_workers_deeper(cluster, tmp_path):
    """4 workers x 1 micro-batch, 6 blocks, 10 steps: the arrival order of the four gradients
    varies from run to run, the result must not."""
    out = tmp_path / "model.safetensors"
    args = ["--layers", "6", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--vocab",
            "64", "--micro-batch-size", "4", "--threads", "1"]
    cluster.run_job(4, *args, "--model", "gpt", "--steps", "10", "--micro-batches", "1",
                    "--save", str(out), server_args=("--lr", "1e-3"), timeout=400)
    want = train_resident(ModelConfig(model="gpt", **{**SMALL_CFG, "layers": 6}), steps=10,
                          global_micro_batches=4, batch_size=4, lr=1e-3)
    assert_close(load_file(str(out)), want)


@pytest.mark.slow  # test_global_clipping_equals_clip_grad_norm checks it too, in both modes
@pytest.mark.parametrize("update", ["eager", "deferred"])
def test_final_checkpoint_holds_the_last_step(cluster, tmp_path, update):
    """The EPS exits after the workers' Bye only once the last updates are in, so its final
    checkpoint is the last step (not skipped as "mid-step"), in both update modes."""
    ckpt = tmp_path / "ckpt"
    cluster.run_job(2, *SMALL, "--steps", "3",
                    server_args=("--server-save", str(ckpt), "--update", update))
    state = json.loads(open(os.path.join(resolve(str(ckpt)), "state.json")).read())
    assert state["step"] == 3 and set(state["versions"]) == {3}
    assert "mid-step" not in cluster.log(cluster.server)


@pytest.mark.parametrize("model, extra", [
    ("gpt", ("--tie-embeddings", "--transport", "frames", "--copy-weights")),
    ("tests.toy_model:GatedModel", ("--stash", "eps")),
], ids=["gpt-tied", "tuple-boundary"])
def test_other_layered_networks_equal_plain_pytorch(cluster, tmp_path, model, extra):
    """Through real processes: a GPT whose LM head is tied to its token embedding (one tensor
    on the EPS, both layers' gradients summed before its update), and a network of our own
    (--model package.module:Class) whose boundary is a tuple with an integer member, kept in
    the EPS's stash arena, and whose head reads the embedding layer's tensor."""
    got = l2l(cluster, tmp_path, model=model, workers=2, micro_batches=2, extra=extra)
    mcfg = ModelConfig(model=model, **SMALL_CFG, tie_embeddings="--tie-embeddings" in extra)
    want = train_resident(mcfg, steps=STEPS, global_micro_batches=4, batch_size=4, lr=1e-3)
    assert_close(got, want)


def test_initial_weights_come_from_a_file_layer_by_layer(cluster, tmp_path):
    """--init-from: the bootstrapping worker reads each layer from the file as it sends it."""
    net = build_model(ModelConfig(model="bert", seed=7, **SMALL_CFG)).assemble()
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, tmp_path / "init.st")
    out = tmp_path / "out.safetensors"
    cluster.run_job(1, *SMALL, "--init-from", str(tmp_path / "init.st"), "--steps", "0",
                    "--save", str(out))
    got = load_file(str(out))
    assert set(got) == set(net.state_dict())
    assert all(torch.equal(got[k], v) for k, v in net.state_dict().items())


# deferred: slow (a skip in each update mode is test_core's
# test_a_layer_every_rank_skips_advances_without_an_update)
@pytest.mark.parametrize("update", ["eager", pytest.param("deferred", marks=pytest.mark.slow)])
def test_layer_drop_through_the_eps(cluster, tmp_path, update):
    """2 workers skip the same blocks each step: neither fetched nor pushed, the EPS advances
    their versions without an update; the result equals a resident model leaving the same
    blocks out (torch AdamW skips parameters without a gradient)."""
    from worker.executor import layer_drop

    got = l2l(cluster, tmp_path, model="gpt", workers=2, micro_batches=2,
              extra=("--layers", "4", "--layer-drop", "0.5"), server=("--update", update))
    skips = {s: frozenset(layer_drop(0, s, 6, 0.5)) for s in range(STEPS)}
    assert any(skips.values())
    want = train_resident(ModelConfig(model="gpt", **{**SMALL_CFG, "layers": 4}), steps=STEPS,
                          global_micro_batches=4, batch_size=4, lr=1e-3,
                          skips=lambda s: skips[s])
    assert_close(got, want)


def test_replicas_asking_for_any_rank_train_the_same_model(cluster, tmp_path):
    """Two identical workers (--rank -1, as containers of one service are) are given ranks 0
    and 1 by the EPS and end where plain training does; each writes its own summary, trace and
    events ({rank} in the paths) and names its rank in its log lines once it has one."""
    out = tmp_path / "model.safetensors"
    cluster.start_server(2, "--lr", "1e-3")
    argv = [sys.executable, "-m", "worker", "--endpoint", cluster.endpoint, "--rank", "-1",
            "--world-size", "2", *SMALL, "--model", "bert", "--steps", str(STEPS),
            "--micro-batches", "2", "--save", str(out),
            "--summary-json", str(tmp_path / "worker-{rank}.json"),
            "--trace", str(tmp_path / "trace-{rank}.json"),
            "--events", str(tmp_path / "events-{rank}.jsonl")]
    replicas = [cluster.spawn(argv, f"replica{i}") for i in range(2)]
    for w in replicas:
        assert cluster.wait(w) == 0, cluster.log(w)
    assert cluster.wait(cluster.server, 60) == 0, cluster.log(cluster.server)
    summaries = [json.loads((tmp_path / f"worker-{r}.json").read_text()) for r in (0, 1)]
    assert sorted(s["pid"] for s in summaries) == sorted(w.pid for w in replicas)
    for s, w in ((s, w) for s in summaries for w in replicas if w.pid == s["pid"]):
        rank = s["rank"]
        assert f"l2l-worker[{rank}] INFO rank {rank}: joined" in cluster.log(w)
        assert json.loads((tmp_path / f"trace-{rank}.json").read_text())["traceEvents"]
        assert f'"rank": {rank}' in (tmp_path / f"events-{rank}.jsonl").read_text()
    want = train_resident(ModelConfig(model="bert", **SMALL_CFG), steps=STEPS,
                          global_micro_batches=4, batch_size=4, lr=1e-3)
    assert_close(load_file(str(out)), want)
