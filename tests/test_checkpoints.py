"""Checkpoint robustness: checksums checked on load (a damaged or truncated file is refused by
name), the newest K kept, and a writer killed at any moment leaves the previous checkpoint
loadable (with real eps-server processes and SIGKILL)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from eps_server import checkpoint
from eps_server.config import OptimizerConfig, ServerConfig
from eps_server.lobby import load_core
from eps_server.optimizers import STATE_DTYPES
from launch.config import LaunchArgs
from protocol import cli
from protocol.checkpoints import CHECKSUMS, LATEST, resolve
from protocol.messages import Ack, Save
from protocol.tensors import LayerSpec, Manifest, TensorSpec, views
from worker.export import main as export_main

from .helpers import ENV, SMALL
from .test_core import Harness, grad_of

LAUNCH = [sys.executable, "-m", "launch", "--quiet"]
EXPORT = [sys.executable, "-m", "worker.export"]


@pytest.fixture
def trained():
    """A core after one step (so master and optimizer state are not trivial)."""
    h = Harness(1)
    h.bootstrap()
    for layer in (2, 1, 0):
        h.push(0, 0, layer, grad_of(layer, 1.0), 10 + layer)
        h.poll()
    yield h
    h.close()


def saved_after_one_step(root, samples_per_step: int, keep: int = 1) -> str:
    """A checkpoint of a core after one step whose workers take ``samples_per_step``."""
    h = Harness(1)
    try:
        h.bootstrap(samples_per_step=samples_per_step)
        for layer in (2, 1, 0):
            h.push(0, 0, layer, grad_of(layer, 1.0), 10 + layer)
        h.poll()
        return save(h, root, keep)
    finally:
        h.close()


def save(h, root, keep=1):
    return checkpoint.save(str(root), h.core.store, [m.optimizer for m in h.core.engines.layers],
                           h.core.scheduler.checkpoint_extra(), keep)


def test_a_damaged_or_truncated_checkpoint_is_refused_by_name(trained, tmp_path):
    directory = save(trained, tmp_path / "ckpt")
    assert checkpoint.read_meta(str(tmp_path / "ckpt")).state["step"] == 1
    master = os.path.join(directory, "master.safetensors")
    data = bytearray(open(master, "rb").read())
    data[-5] ^= 0xFF
    open(master, "wb").write(bytes(data))
    with pytest.raises(ValueError, match="master.safetensors: checksum mismatch"):
        checkpoint.read_meta(str(tmp_path / "ckpt"))
    open(master, "wb").write(bytes(data[:-100]))
    with pytest.raises(ValueError, match="master.safetensors: .* bytes, .* were written"):
        load_core(ServerConfig(run_id="x"), str(tmp_path / "ckpt"), "x")
    os.remove(os.path.join(directory, "checksums.json"))
    with pytest.raises(ValueError, match="checksums.json: missing"):
        checkpoint.read_meta(directory)


def test_the_newest_k_are_kept(trained, tmp_path):
    root = tmp_path / "ckpt"
    written = []
    for _ in range(4):
        written.append(save(trained, root, keep=2))
        time.sleep(0.01)  # distinct modification times
    assert len(set(written)) == 4  # the same step saved again gets a new directory
    assert sorted(os.path.join(root, n) for n in os.listdir(root)
                  if n not in (LATEST, checkpoint.LOCK)) == sorted(written[-2:])
    assert resolve(str(root)) == written[-1]
    assert checkpoint.read_meta(str(root)).path == written[-1]
    with pytest.raises(ValueError, match="not a checkpoint root"):
        (tmp_path / "notes").mkdir()
        (tmp_path / "notes" / "a.txt").write_text("keep")
        save(trained, tmp_path / "notes")


def test_a_checkpoint_folder_has_one_writer_and_is_checked_before_training(trained, tmp_path):
    """Two servers given one --server-save pruned each other's checkpoints, even those being
    written: the second is refused at start, before training; so is a folder that cannot be
    made (it used to fail at the first checkpoint, after the training it was to keep)."""
    import subprocess

    from .helpers import ENV

    root = tmp_path / "ckpt"

    def server(save: str):
        return subprocess.run([sys.executable, "-m", "eps_server", "--endpoint",
                               f"ipc://{tmp_path}/other.sock", "--world-size", "1",
                               "--server-save", save, "--exit-when-done"], env=ENV,
                              capture_output=True, text=True, timeout=60)

    checkpoint.hold_root(str(root))  # as a serving EPS holds its --server-save
    try:
        save(trained, root)  # its own checkpoints still go there
        out = server(str(root))
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert f"checkpoint folder {root} is in use by another process" in out.stderr
        assert sorted(os.listdir(root)) == sorted([".lock", LATEST, "step-00000001"])
    finally:
        checkpoint.release_root(str(root))
    assert save(trained, root)  # released: a folder may be written by one process at a time
    out = server("/proc/1/ckpt")
    assert out.returncode == 2 and "cannot write checkpoints to /proc/1/ckpt" in out.stderr, \
        out.stderr


def test_a_folder_of_another_models_checkpoints_is_refused_not_pruned(trained, tmp_path):
    """Writing into a root of another model's checkpoints would prune them (``keep``) and point
    its ``latest`` at this model: refused by every path (a direct save, ``l2l-ctl save``, a
    ``--server-save`` given at start), the root left as it was."""
    from .test_core import Harness

    root = tmp_path / "theirs"
    other = Manifest(layers=tuple(LayerSpec(name=f"l{i}", kind="k", tensors=(
        TensorSpec(name="w", shape=(5,)),)) for i in range(3)), meta={"model": "another"})
    h = Harness(1, manifest=other)
    try:
        h.bootstrap()
        save(h, root)
    finally:
        h.close()
    before = sorted(os.listdir(root))
    with pytest.raises(ValueError, match=f"{root} holds checkpoints of another model"):
        save(trained, root)
    trained.send(0, Save(req_id=7, path=str(root)))
    refused = trained.take(0, 7).msg
    assert refused.code == "bad_request" and "another model" in refused.message, refused
    late = Harness(1, save=str(root))  # --server-save
    try:
        refused = late.hello(0)
        assert refused.code == "bad_request" and "another model" in refused.message, refused
        assert late.core is None
    finally:
        late.close()
    assert sorted(os.listdir(root)) == before
    assert checkpoint.read_meta(str(root)).manifest == other
    assert save(trained, tmp_path / "ours") and save(trained, tmp_path / "ours")  # its own


def test_a_root_without_latest_resolves_to_its_newest_checkpoint(tmp_path):
    """A writer stopped between renaming its first checkpoint into place and writing `latest`
    leaves a complete one: a restart resumes from it instead of refusing the root."""
    for name in ("step-00000003", "step-00000005", "step-00000005-1", ".step-00000007.tmp-1"):
        (tmp_path / name).mkdir()
    assert resolve(str(tmp_path)) == str(tmp_path / "step-00000005-1")
    (tmp_path / LATEST).write_text("step-00000003\n")
    assert resolve(str(tmp_path)) == str(tmp_path / "step-00000003")


def test_only_our_own_hidden_entries_pass_for_an_empty_root(tmp_path):
    checkpoint.check_target(str(tmp_path))
    (tmp_path / ".lock").write_text("")
    (tmp_path / ".step-00000001.tmp-9").mkdir()
    checkpoint.check_target(str(tmp_path))
    (tmp_path / ".git").mkdir()  # someone's folder, not a checkpoint root
    with pytest.raises(ValueError, match="not a checkpoint root"):
        checkpoint.check_target(str(tmp_path))


def test_a_folder_that_cannot_be_read_is_refused_before_the_model_exists(tmp_path,
                                                                         monkeypatch):
    """A Save before the model exists, to a folder the EPS cannot list, got `internal` (a
    PermissionError's traceback in its log); now `bad_request` on `path`, as with a model."""
    from .test_core import Harness

    listdir = os.listdir

    def denied(path="."):
        if str(path) == str(tmp_path / "theirs"):
            raise PermissionError(13, "Permission denied")
        return listdir(path)

    (tmp_path / "theirs").mkdir()
    monkeypatch.setattr(os, "listdir", denied)
    h = Harness(1)
    try:
        h.send(0, Save(req_id=3, path=str(tmp_path / "theirs")))
        refused = h.take(0, 3).msg
        assert (refused.code, refused.field) == ("bad_request", "path"), refused
        assert "cannot read" in refused.message and "Permission denied" in refused.message
    finally:
        h.close()


def test_a_file_system_without_locks_is_written_unguarded(tmp_path, monkeypatch, caplog):
    import errno

    def refuse(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(checkpoint.fcntl, "flock", refuse)
    root = str(tmp_path / "ck")
    assert checkpoint.hold_root(root) and not checkpoint.hold_root(root)  # held once
    checkpoint.release_root(root)
    assert "refuses locks (No locks available)" in caplog.text


def test_keep_checkpoints_keeps_the_newest_written_also_in_a_copied_folder(trained, tmp_path):
    """A folder copied with cp -r has the copy's times (here: the newest checkpoint looks the
    oldest); pruning went by them and removed the newest checkpoint, the one resumed from.
    It goes by the time each checkpoint's state.json says it was written."""
    root = tmp_path / "ck"
    made = [save(trained, root, keep=3) for _ in range(3)]
    for age, path in enumerate(made):  # the first written looks the newest
        os.utime(path, (2e9 - 100 * age, 2e9 - 100 * age))
    newest = save(trained, root, keep=2)
    assert sorted(p.name for p in root.glob("step-*")) == sorted(
        os.path.basename(p) for p in (made[-1], newest))


def test_a_final_checkpoint_repeats_the_loaded_one_only_where_it_is_the_latest(trained,
                                                                               tmp_path):
    """Resumed from the root's latest and stopped before training: nothing new written. From
    an older one: it is written again (it becomes the latest, as a user resuming from it
    expects of the next --load of the root)."""
    root = tmp_path / "ck"
    older = save(trained, root, keep=3)
    newest = save(trained, root, keep=3)
    for path, written in ((str(root), False), (older, True)):
        before = set(os.listdir(root))
        cfg = replace(trained.cfg, save=str(root), keep_checkpoints=3)
        said = []
        core = load_core(cfg, path, cfg.run_id, notify=said.append)
        core.close(final_save=True)
        assert (set(os.listdir(root)) != before) is written
        # the launcher is told the load goes on (its patience counts from the last of these)
        phases = [ev.phase for ev in said]  # checking each file (and before), then loading
        assert phases[0] == "checking" and phases[-1] == "loading", said
        assert phases.count("checking") == 1 + len(json.loads(
            open(os.path.join(resolve(path), CHECKSUMS)).read())), said
        assert said[-1].done == said[-1].total == 3, said
    assert resolve(str(root)) not in (older, newest)  # the older one, written again


def test_a_run_resumed_with_another_batch_shape_goes_on_from_the_samples_consumed(tmp_path):
    """The workers say how many samples a step takes; a checkpoint records the samples its
    steps consumed, and a run resumed from it with another batch shape gets that as its
    origin (its step 1 starts at sample 16, not at 1 x 8); its own checkpoints go on counting
    from there. Workers of one job that disagree are refused; a checkpoint that records
    nothing (an older one) counts step x samples a step, as before."""
    from eps_server.data_position import DataPosition
    from protocol.messages import Error

    h = Harness(2)
    try:
        refused = h.hello(1, samples_per_step=8, req_id=7)
        assert not isinstance(refused, Error)  # the first to say sets the job's
        refused = h.hello(0, samples_per_step=16)
        assert isinstance(refused, Error) and refused.field == "samples_per_step", refused
    finally:
        h.close()
    root = saved_after_one_step(tmp_path / "a", samples_per_step=16)
    assert checkpoint.read_meta(root).state["data"] == {"samples": 16, "per_step": 16}
    r = Harness(1)
    r.core = load_core(r.cfg, root, r.cfg.run_id,
                       inline=True, clock=lambda: r.now)
    try:
        welcome = r.hello(0, samples_per_step=8)
        assert (welcome.step, welcome.data_step, welcome.data_samples) == (1, 1, 16)
        for layer in (2, 1, 0):
            r.push(0, 1, layer, grad_of(layer, 1.0), 20 + layer)
            r.poll()
        assert r.core.scheduler.checkpoint_extra()["data"] == {"samples": 24, "per_step": 8}
    finally:
        r.close()
    older = {k: v for k, v in checkpoint.read_meta(root).state.items() if k != "data"}
    position = DataPosition()
    position.loaded(1, older)
    assert position.record(1) is None  # (a final checkpoint with no worker: as loaded)
    assert position.joined(8) == (1, 8) and position.record(3) == {"samples": 24, "per_step": 8}


def test_a_resumed_run_of_another_batch_shape_that_trains_nothing_writes_nothing(tmp_path):
    """The data's record (samples a step) differs once a worker of another batch shape has
    joined: a run resumed from the latest that trained nothing wrote the same step again."""
    saved_after_one_step(tmp_path / "ck", samples_per_step=8, keep=3)
    before = set(os.listdir(tmp_path / "ck"))
    r = Harness(1)
    cfg = replace(r.cfg, save=str(tmp_path / "ck"), keep_checkpoints=3)
    r.core = load_core(cfg, str(tmp_path / "ck"), cfg.run_id, inline=True, clock=lambda: r.now)
    assert r.hello(0, samples_per_step=4).data_samples == 8
    r.core.close(final_save=True)
    assert set(os.listdir(tmp_path / "ck")) == before


def test_a_checkpoint_of_another_optimizer_is_refused_saying_which(tmp_path):
    """An AdamW checkpoint resumed as SGD with momentum lacks its momentum buffers: the refusal
    said only that, not that the checkpoint was another optimizer's."""
    h = Harness(1, optimizer=OptimizerConfig(name="adamw", lr=0.01))
    try:
        h.bootstrap()
        root = save(h, tmp_path / "ck")
    finally:
        h.close()
    cfg = replace(h.cfg, optimizer=OptimizerConfig(name="sgd", lr=0.1, momentum=0.9))
    with pytest.raises(ValueError, match="missing: the checkpoint was trained with --optimizer "
                       "adamw, whose state --optimizer sgd cannot go on from"):
        load_core(cfg, root, cfg.run_id)


def test_the_loss_scale_is_restored_only_from_a_checkpoint_trained_in_fp16(tmp_path):
    """An fp16 run resumed in fp16 goes on with its scale (GradScaler's state); from a bf16 or
    fp32 checkpoint (whose disabled scaler says 1) it starts at --loss-scale, and a run
    resumed in bf16 from an fp16 checkpoint scales nothing."""
    roots = {}
    for precision in ("fp16", "bf16"):
        h = Harness(1, precision=precision, loss_scale=512.0)
        try:
            h.bootstrap(grad_dtype="compute")
            roots[precision], base = save(h, tmp_path / precision), h.cfg
        finally:
            h.close()
    for trained_in, precision, scale in (("fp16", "fp16", 512.0), ("bf16", "fp16", 1024.0),
                                         ("fp16", "bf16", 1.0)):
        cfg = replace(base, precision=precision, loss_scale=1024.0)
        core = load_core(cfg, roots[trained_in], cfg.run_id)
        try:
            assert core.scheduler.scaler.scale == scale, (trained_in, precision)
        finally:
            core.close(final_save=False)


def test_a_checkpoint_records_its_moments_dtype_and_loads_into_the_other(tmp_path):
    """--optimizer-states: a checkpoint holds the moments in their dtype and says which; loaded
    by a server of the other kind they are converted (bf16 -> fp32 exactly, fp32 -> bf16
    rounded to nearest), the master as it was."""
    cores = {}
    for states in ("bf16", "fp32"):
        h = Harness(1, optimizer=OptimizerConfig(name="adamw", lr=0.01, states=states))
        h.bootstrap()
        for layer in (2, 1, 0):
            h.push(0, 0, layer, grad_of(layer, 1.0 + layer), 10 + layer)
            h.poll()
        cores[states] = h
    try:
        for states, other in (("bf16", "fp32"), ("fp32", "bf16")):
            h = cores[states]
            root = save(h, tmp_path / states)
            meta = checkpoint.read_meta(root)
            assert meta.state["optimizer"]["states"] == states
            cfg = replace(cores[other].cfg, run_id="l" + states)
            core = load_core(cfg, root, cfg.run_id)
            try:
                for ours, theirs in zip(core.engines.layers, h.core.engines.layers):
                    mine, src = ours.optimizer, theirs.optimizer
                    assert mine.exp_avg.dtype == STATE_DTYPES[other]
                    assert torch.equal(mine.exp_avg, src.exp_avg.to(mine.exp_avg.dtype))
                    assert torch.equal(mine.exp_avg_sq, src.exp_avg_sq.to(mine.exp_avg.dtype))
                    assert all(torch.equal(a, b) for a, b in zip(views(mine.master, mine.plan),
                                                                 views(src.master, src.plan)))
            finally:
                core.close(final_save=False)
    finally:
        for h in cores.values():
            h.close()


@pytest.mark.slow
def test_killing_the_eps_while_it_writes_leaves_a_loadable_checkpoint(cluster, tmp_path):
    """The EPS checkpoints a 28M-parameter model (about 340 MB with AdamW state) after every
    step; it is SIGKILLed at random moments, 6 times. Each time the root's latest checkpoint
    loads, checksums and all, and the next server resumes from it."""
    root = tmp_path / "ckpt"
    rng = random.Random(0)
    args = ["--layers", "8", "--hidden", "512", "--heads", "8", "--seq-len", "16", "--vocab",
            "64", "--micro-batch-size", "2", "--micro-batches", "1", "--threads", "1"]
    kills, steps_seen, mid_write = 0, [], 0
    while kills < 6:
        extra = ("--load", str(root)) if os.path.exists(root / LATEST) else ()
        cluster.start_server(1, "--server-save", str(root), "--checkpoint-every", "1", *extra)
        w = cluster.worker(0, 1, *args, "--steps", "1000", "--eps-timeout", "30")
        time.sleep(rng.uniform(2.0, 6.0))
        os.killpg(cluster.server.pid, signal.SIGKILL)
        cluster.server.wait()
        cluster.wait(w, 60)
        kills += 1
        mid_write += any(".tmp-" in n for n in os.listdir(root)) if root.exists() else 0
        if os.path.exists(root / LATEST):
            state = checkpoint.read_meta(str(root)).state  # checksums verified
            steps_seen.append(state["step"])
        cluster.close()
    assert steps_seen and steps_seen == sorted(steps_seen), steps_seen
    assert mid_write >= 1  # some kills did land while a checkpoint was being written
    print(f"checkpoint kill trials: {kills} kills, {mid_write} while writing; latest step "
          f"after each: {steps_seen}", file=sys.stderr)



def test_a_save_the_os_refuses_is_an_error_reply_and_leaves_the_last_checkpoint(
        trained, tmp_path, monkeypatch, caplog):
    """l2l-ctl save into a path the EPS cannot write (under /proc) is refused at once with
    bad_request; one that fails while written (a full disk: ENOSPC from the master's file) gets
    a `resource` error naming the OS's reason, with no traceback logged, no partial files
    left, the previous checkpoint still the latest and loadable, the failure counted; and the
    next Save there is tried again and succeeds."""
    import errno
    import logging

    from protocol.messages import Ack, Error, Save

    h = trained
    events = []
    h.core.saves.notify = events.append
    h.send(0, Save(req_id=30, path="/proc/self/ck"))
    bad = h.take(0, 30).msg
    assert isinstance(bad, Error) and bad.code == "bad_request" and bad.field == "path", bad
    assert "cannot write checkpoints to /proc/self/ck" in bad.message

    root = tmp_path / "ck"
    good = save(h, root)
    real = checkpoint.write_safetensors

    def full(path, tensors, metadata=None, digest=False):
        real(path, tensors[:1], metadata)  # a part is written, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(checkpoint, "write_safetensors", full)
    with caplog.at_level(logging.INFO, logger="eps_server"):
        h.send(0, Save(req_id=31, path=str(root)))
        h.poll()
    refused = h.take(0, 31).msg
    assert isinstance(refused, Error) and refused.code == "resource", refused
    assert "No space left on device [ENOSPC]" in refused.message, refused.message
    assert "Traceback" not in caplog.text and not any(r.exc_info for r in caplog.records)
    assert f"the latest good one there is step 1 ({good})" in caplog.text, caplog.text
    assert sorted(os.listdir(root)) == sorted([checkpoint.LOCK, LATEST, "step-00000001"])
    assert resolve(str(root)) == good and checkpoint.read_meta(str(root)).state["step"] == 1
    assert h.core.stats.checkpoint_failures == 1 and h.core.stats.checkpoints_written == 0
    # answered with the error, and not one of the job's checkpoints: the launcher is not told
    # (a failed l2l-ctl save must not fail a job run with --checkpoint-errors fail)
    assert events == []

    monkeypatch.setattr(checkpoint, "write_safetensors", real)
    h.send(0, Save(req_id=32, path=str(root)))
    h.poll()
    assert isinstance(h.take(0, 32).msg, Ack)
    assert resolve(str(root)) != good and checkpoint.read_meta(str(root)).state["step"] == 1
    assert h.core.stats.checkpoints_written == 1 and h.core.stats.last_checkpoint_step == 1


def test_a_checkpoint_records_the_job_model_options_and_a_resumed_eps_keeps_them(tmp_path):
    """The EPS keeps the job's model options (l2l-launch gives them) opaque, in each
    checkpoint's state.json, for l2l-export; one resumed without them keeps the loaded
    checkpoint's. What a failure says to restart from is the checkpoint written or loaded."""
    model = {"model": "gpt", "layers": 2}
    h = Harness(1, model_options=json.dumps(model))
    try:
        h.bootstrap()
        assert "no checkpoint to restart it from" in h.core.saves.resume_hint()
        h.send(0, Save(req_id=30, path=str(tmp_path / "ck")))
        h.poll()
        assert isinstance(h.take(0, 30).msg, Ack)
        assert h.core.saves.resume_hint() == (f"restart it with --load {tmp_path / 'ck'} (its "
                                              "checkpoint of step 0)")
    finally:
        h.close()
    assert checkpoint.read_meta(str(tmp_path / "ck")).state["model"] == model
    core = load_core(replace(h.cfg, model_options=""), str(tmp_path / "ck"), "x")
    try:
        assert core.scheduler.checkpoint_extra()["model"] == model
        assert f"--load {resolve(str(tmp_path / 'ck'))} (its" in core.saves.resume_hint()
    finally:
        core.close(final_save=False)
    with pytest.raises(ValueError, match="model_options must be a JSON map"):
        ServerConfig(model_options="[1]")


def test_l2l_export_needs_no_model_options_for_a_launched_job(tmp_path, capsys):
    """A checkpoint of an l2l-launch job records its model options: l2l-export needs none (it
    said "6 layers vs 5" without them); given ones override them."""
    p = subprocess.run([*LAUNCH, "--model", "gpt", *SMALL, "--steps", "2", "--server-save",
                        "ckpt", "--save", "m.safetensors"], env=ENV, cwd=tmp_path,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr
    export = subprocess.run([*EXPORT, "ckpt", "x.safetensors"],  # --checkpoint, --out
                            env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr
    saved, exported = (load_file(str(tmp_path / f)) for f in ("m.safetensors", "x.safetensors"))
    assert saved.keys() == exported.keys()
    assert all(torch.equal(saved[k], exported[k]) for k in saved)
    capsys.readouterr()  # l2l-export's main in this process: what its process would exit with
    assert export_main(["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "y"),
                        "--layers", "3"]) == 1
    assert "do not describe the checkpoint's model" in capsys.readouterr().err
    # CKPT OUT anywhere among the flags (they had to come first), or the one not given as one
    ckpt = str(tmp_path / "ckpt")
    for i, argv in enumerate((["--layers", "2", ckpt, "{}"], [ckpt, "--layers", "2", "{}"],
                              ["--out", "{}", ckpt])):
        out = str(tmp_path / f"z{i}.safetensors")
        assert export_main([a.replace("{}", out) for a in argv]) == 0, capsys.readouterr().err
        assert load_file(out).keys() == saved.keys()
    with pytest.raises(SystemExit):
        export_main([ckpt, "out", "more"])
    assert "unrecognized arguments: more" in capsys.readouterr().err


def test_l2l_export_reads_the_model_from_a_job_file(cluster, tmp_path, capsys):
    """A checkpoint whose EPS was not told the model (started by hand): l2l-export says how to
    give it, and takes l2l-launch's job file (runs/<id>/config.json) with --config, its other
    sections ignored."""
    model = ["--model", "gpt", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len",
             "16", "--vocab", "64"]
    cluster.run_job(1, *model, *SMALL[-4:], "--steps", "1",
                    server_args=("--server-save", str(tmp_path / "ckpt")))
    capsys.readouterr()  # l2l-export's main in this process: what its process would exit with
    assert export_main(["--checkpoint", str(tmp_path / "ckpt"), "--out",
                        str(tmp_path / "x.safetensors")]) == 1
    err = capsys.readouterr().err
    assert f"--config runs/{cluster.run_id}/config.json" in err, err
    job = cli.parse(LaunchArgs, [*model, "--workers", "2", "--data", "d.txt", "--lr", "0.5"], "t")
    cli.write_file(job, str(tmp_path / "config.json"))
    p = subprocess.run([*EXPORT, "--checkpoint", "ckpt", "--out", "x.safetensors", "--config",
                        "config.json"], env=ENV, cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "x.safetensors").exists()


def test_the_checkpoints_a_root_offers_end_at_its_latest(tmp_path):
    """What a box offers when the boxes agree on a checkpoint (protocol.checkpoints.held):
    every complete one of the root up to the one --load would pick (latest), newest first, a
    step saved twice by its last save; not a newer one of an abandoned history, nor one still
    being written."""
    from protocol.checkpoints import held

    for name in ("step-00000002", "step-00000004", "step-00000004-1", "step-00000100",
                 ".step-00000006.tmp"):
        (tmp_path / name).mkdir()
    (tmp_path / "latest").write_text("step-00000004-1")
    assert held(str(tmp_path)) == [(4, str(tmp_path / "step-00000004-1")),
                                   (2, str(tmp_path / "step-00000002"))]
    (tmp_path / "latest").unlink()  # (a writer stopped before its first pointer: the newest)
    assert [step for step, _ in held(str(tmp_path))] == [100, 4, 2]


def test_a_box_lost_while_the_boxes_write_is_no_checkpoint_failure(tmp_path, caplog):
    """Shard mode: a box killed while the boxes wrote a checkpoint made it a CheckpointFailed,
    which --checkpoint-errors fail stopped the whole job for (no restart), and which the exit
    warning counted. It is the boxes' group that failed: the EPS exits for a restart."""
    from eps_server.saving import SaveOutcomes
    from eps_server.scheduler import Saved
    from eps_server.stats import EpsStats

    said = []
    outcomes = SaveOutcomes(EpsStats(), said.append)
    outcomes.settle(Saved(None, str(tmp_path), 6, "BoxLost: box 1 is gone", lost=True))
    assert said == [] and outcomes.stats.checkpoint_failures == 0
    assert "checkpoint of step 6 to" in caplog.text and "cut off" in caplog.text
    outcomes.settle(Saved(None, str(tmp_path), 7, "No space left on device", refused=True))
    assert [ev.step for ev in said] == [7] and outcomes.stats.checkpoint_failures == 1
    from eps_server.boxes import BoxLost

    def cut():
        raise BoxLost("box 1 is gone")

    outcomes.final(cut, 9, str(tmp_path))  # at exit nothing restarts: the final one failed
    assert [(ev.step, ev.final) for ev in said[1:]] == [(9, True)]
