"""l2l, the Python API: ``l2l.run`` trains what ``l2l-launch`` trains with the same options and
returns its summary, raises JobFailed for a failed job and KeyboardInterrupt on Ctrl-C, leaving
no process and no shared memory behind either way; ``l2l.export`` writes what ``l2l-export``
writes. Real processes, small models."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys

import pytest

import l2l

from .helpers import ENV, SMALL
from .test_launch import assert_nothing_left

# tests/helpers.SMALL as keyword arguments: flags without their dashes, "-" made "_"
SMALL_KW = {flag[2:].replace("-", "_"): int(value) for flag, value in zip(SMALL[::2], SMALL[1::2])}
JOB = dict(workers=2, model="bert", steps=4, micro_batches=2, lr=3e-3, **SMALL_KW)
MODEL_KW = {k: SMALL_KW[k] for k in ("layers", "hidden", "heads", "seq_len", "vocab")}


def _flags(options: dict) -> list[str]:
    return [a for k, v in options.items() for a in (f"--{k.replace('_', '-')}", str(v))]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One job through l2l.run: its summary, its model (--save) and its checkpoint."""
    d = tmp_path_factory.mktemp("api")
    endpoint = f"ipc://{d}/eps.sock"
    summary = l2l.run(**JOB, save=d / "api.safetensors", server_save=d / "ckpt",
                      endpoint=endpoint, runs_dir=d / "runs", quiet=True)
    assert_nothing_left(endpoint, summary["run_id"])
    return d, summary


def test_run_returns_the_summary_and_trains_what_l2l_launch_trains(trained):
    d, s = trained
    assert s["ok"] and s["steps"] == 4 and len(s["losses"]) == 4 and s["world_size"] == 2
    assert s["save"] == str(d / "api.safetensors")
    assert s["config"]["model"]["layers"] == 2 and s["config"]["worker"]["steps"] == 4
    cli = subprocess.run([sys.executable, "-m", "launch", "--quiet", *_flags(JOB), "--save",
                          "cli.safetensors", "--summary-json", "cli.json"], env=ENV, cwd=d,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    expected = json.loads((d / "cli.json").read_text())
    assert sorted(s) == sorted(expected) and s["losses"] == expected["losses"]
    assert (d / "api.safetensors").read_bytes() == (d / "cli.safetensors").read_bytes()


def test_export_writes_what_l2l_export_writes(trained):
    d, _ = trained
    assert l2l.export(d / "ckpt", d / "api-export.safetensors", model="bert", **MODEL_KW) == 4
    cli = subprocess.run([sys.executable, "-m", "worker.export", "--checkpoint", "ckpt",
                          "--out", "cli-export.safetensors", "--model", "bert",
                          *_flags(MODEL_KW)], env=ENV, cwd=d, capture_output=True, text=True,
                         timeout=120)
    assert cli.returncode == 0, cli.stderr
    exported = (d / "api-export.safetensors").read_bytes()
    assert exported == (d / "cli-export.safetensors").read_bytes()
    # the job's own config describes the model as well
    l2l.export(d / "ckpt", d / "again.safetensors", config=l2l.config(**JOB))
    assert (d / "again.safetensors").read_bytes() == exported
    # and, as for l2l-export, the options the checkpoint records (it refused them: defaults)
    l2l.export(d / "ckpt", d / "recorded.safetensors")
    assert (d / "recorded.safetensors").read_bytes() == exported
    with pytest.raises(ValueError, match="do not describe the checkpoint's model"):
        l2l.export(d / "ckpt", d / "wrong.safetensors", model="bert", **{**MODEL_KW,
                                                                          "layers": 3})


def test_options_are_checked_as_the_command_line_checks_them(tmp_path):
    with pytest.raises(TypeError, match="'layer' .*did you mean 'layers'"):
        l2l.run(layer=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'nonsense'"):
        l2l.Job(nonsense=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'steps'"):
        l2l.export("ckpt", "out", steps=3)  # not a model option
    with pytest.raises(ValueError, match="layers: expected int"):
        l2l.Job(layers="4")
    with pytest.raises(ValueError, match="workers must be >= 1"):
        l2l.Job(workers=0)
    # a job file, then keyword arguments over it (as --config FILE and flags)
    (tmp_path / "job.yaml").write_text("model: {layers: 6, hidden: 48}\nworker: {steps: 9}\n")
    job = l2l.Job(config=tmp_path / "job.yaml", steps=30, lr=1e-3)
    a = job.config
    assert (a.model.layers, a.model.hidden, a.worker.steps, a.server.optimizer.lr) == \
        (6, 48, 30, 1e-3)
    # a config object, and a map, under keyword arguments
    assert l2l.config(config=a, layers=3).model.layers == 3 and a.model.layers == 6
    assert l2l.config({"launch": {"workers": 3}}, steps=2).launch.workers == 3
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="^save .*cannot make its folder"):  # before it starts
        l2l.run(save=tmp_path / "file" / "m.safetensors")
    with pytest.raises(ValueError, match="^data .*: no such file"):
        l2l.run(data=tmp_path / "missing.tsv")


def test_a_failed_job_raises_job_failed_and_leaves_nothing(tmp_path):
    endpoint, run_id = f"ipc://{tmp_path}/eps.sock", "tapi" + os.urandom(3).hex()
    with pytest.raises(l2l.JobFailed) as failed:
        l2l.run(**{**JOB, "steps": 20}, fault="1:1:F1", endpoint=endpoint, run_id=run_id,
                runs_dir=tmp_path / "runs", quiet=True)
    e = failed.value
    assert "w1 was killed by SIGKILL" in e.failure and e.failure in str(e)
    assert not e.summary["ok"] and e.summary["run_id"] == run_id
    assert e.logs == str(tmp_path / "runs" / run_id)
    assert_nothing_left(endpoint, run_id)


class _CtrlCAfterFirstStep(io.StringIO):
    """stdout that presses Ctrl-C (SIGINT to this process) when the first step is printed:
    from the launcher's event thread, as a keyboard's would arrive."""

    pressed = False

    def write(self, text: str) -> int:
        if text.startswith("step ") and not self.pressed:
            self.pressed = True
            os.kill(os.getpid(), signal.SIGINT)
        return super().write(text)


def test_ctrl_c_stops_every_child_and_raises_keyboard_interrupt(tmp_path, monkeypatch):
    endpoint, run_id = f"ipc://{tmp_path}/eps.sock", "tapi" + os.urandom(3).hex()
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(sys, "stdout", _CtrlCAfterFirstStep())
    with pytest.raises(KeyboardInterrupt):
        l2l.run(**{**JOB, "steps": 500}, endpoint=endpoint, run_id=run_id,
                runs_dir=tmp_path / "runs", quiet=True)
    assert sys.stdout.pressed
    assert_nothing_left(endpoint, run_id)
    assert {s: signal.getsignal(s) for s in before} == before
    s = json.loads((tmp_path / "runs" / run_id / "summary.json").read_text())
    assert not s["ok"] and s["failure"] == "stopped by signal SIGINT" and 1 <= s["steps"] < 500
