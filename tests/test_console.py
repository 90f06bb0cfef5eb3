"""What l2l-launch shows: a bar on a terminal, a plain line every N steps elsewhere, children's
logs in the run directory with only their warnings and errors on the console."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys

import pytest

from launch.console import Console

from .helpers import ENV, SMALL


def launch(tmp_path, *args):
    """l2l-launch as a user runs it (not --quiet), in ``tmp_path``."""
    summary = tmp_path / "summary.json"
    p = subprocess.run([sys.executable, "-m", "launch", "--endpoint", f"ipc://{tmp_path}/e.sock",
                        "--summary-json", str(summary), *args], env=ENV, cwd=tmp_path,
                       capture_output=True, text=True, timeout=240)
    return p, json.loads(summary.read_text()), None


def row(step: int, loss: float = 1.0) -> dict:
    return {"step": step, "loss": loss, "accuracy": 0.5, "seconds": 0.5, "samples": 16,
            "fetch_wait": 0.1, "push_wait": 0.05, "compute": 0.35}


def test_not_a_terminal_prints_every_n_steps_and_the_last(tmp_path):
    out = io.StringIO()
    c = Console(12, str(tmp_path), every=5, out=out, tty=False)
    c.start()
    for s in range(12):
        c.step(row(s, loss=s / 8))
    c.close()
    steps = [int(m) for m in re.findall(r"^step +(\d+)/12", out.getvalue(), re.M)]
    assert steps == [1, 5, 10, 12]
    assert "step    12/12  loss 1.3750" in out.getvalue()  # the step's own loss (11 / 8)
    assert "32 samples/s" in out.getvalue() and "compute 70% wait weights 20% acks 10%" in \
        out.getvalue()


def test_a_terminal_gets_one_bar_with_a_smoothed_loss(tmp_path):
    out = io.StringIO()
    c = Console(4, str(tmp_path), out=out, tty=True)
    c.start()
    for s, loss in enumerate([2.0, 0.0, 0.0, 0.0]):
        c.step(row(s, loss))
    c.close()
    text = out.getvalue()
    assert "4/4" in text and "step " not in text  # a bar, not lines
    assert "loss 1.4580" in text  # 2.0 * 0.9^3: smoothed, not the last value


def test_children_logs_go_to_files_and_only_warnings_reach_the_console(tmp_path, capsys):
    c = Console(1, str(tmp_path / "run"), out=io.StringIO(), tty=False)
    c.log("eps", "2026-01-01 eps-server INFO step 3 complete\n")
    c.log("w1", "2026-01-01 l2l-worker[1] WARNING rank 1: waiting\n")
    c.log("w1", "Traceback (most recent call last):\n")
    c.log("w0", "2026-01-01 10:00:00,001 l2l-worker[0] ERROR no tokenizer (tried:\n")
    c.log("w0", "  (1) tokenizer.json\n")  # the rest of that error record
    c.log("w0", "2026-01-01 10:00:00,002 l2l-worker[0] INFO bye\n")
    c.log("w0", "a line of nothing\n")
    c.close()
    err = capsys.readouterr().err
    assert "[w0] 2026-01-01 10:00:00,001 l2l-worker[0] ERROR no tokenizer (tried:\n" \
        "[w0]   (1) tokenizer.json\n" in err
    assert "bye" not in err and "a line of nothing" not in err
    assert "[w1] 2026-01-01 l2l-worker[1] WARNING rank 1: waiting" in err
    assert "[w1] Traceback" in err and "INFO" not in err
    assert (tmp_path / "run" / "eps.log").read_text() == \
        "2026-01-01 eps-server INFO step 3 complete\n"
    assert len((tmp_path / "run" / "w1.log").read_text().splitlines()) == 2
    v = Console(1, str(tmp_path / "v"), verbose=True, out=io.StringIO(), tty=False)
    v.log("eps", "x INFO y")
    v.close()
    assert "[eps] x INFO y" in capsys.readouterr().err


def test_a_disk_that_refuses_the_logs_loses_lines_not_the_job(tmp_path, capsys):
    """A full disk (/dev/full) under a child's log: its lines are lost, the error kept for the
    launcher to say once the job ends; the other logs and the console go on."""
    import os

    run = tmp_path / "run"
    run.mkdir()
    os.symlink("/dev/full", run / "w0.log")
    c = Console(1, str(run), out=io.StringIO(), tty=False)
    c.log("w0", "2026-01-01 l2l-worker[0] ERROR lost on the disk\n")
    c.log("eps", "2026-01-01 eps-server INFO kept\n")
    c.close()
    assert isinstance(c.log_error, OSError) and "No space left" in str(c.log_error)
    assert (run / "eps.log").read_text() == "2026-01-01 eps-server INFO kept\n"
    assert "[w0] 2026-01-01 l2l-worker[0] ERROR lost on the disk" in capsys.readouterr().err
    assert c.errors["w0"].endswith("ERROR lost on the disk")


def test_a_run_id_in_use_or_an_unusable_runs_dir_is_refused_before_anything(tmp_path):
    """A second job given a running job's --run-id would write over that job's config.json
    and withdraw its endpoint file (l2l-ctl could no longer find it); a --runs-dir that
    cannot be made or written failed with a traceback: each is refused before any file of the
    run is written, with nothing left behind."""
    import glob
    import os

    from launch.rundir import base_dir, publish_endpoint, withdraw_endpoint

    runs = tmp_path / "runs"
    publish_endpoint(str(runs / "busy"), "ipc:///elsewhere")  # a job that runs
    (runs / "busy" / "config.json").write_text("{}")
    (tmp_path / "file").write_text("")
    before = set(glob.glob(os.path.join(base_dir(), "l2l-run-*")))
    try:
        for args, why in ((["--run-id", "busy"], "--run-id busy: a job of this run id runs "
                           f"under {runs}"),
                          (["--runs-dir", str(tmp_path / "file" / "r")], "cannot make it"),):
            p = subprocess.run([sys.executable, "-m", "launch", "--endpoint",
                                f"ipc://{tmp_path}/e.sock", "--runs-dir", str(runs), *SMALL,
                                "--steps", "2", *args], env=ENV, cwd=tmp_path,
                               capture_output=True, text=True, timeout=60)
            assert p.returncode == 2 and why in p.stderr, p.stderr
            assert "Traceback" not in p.stderr
        assert (runs / "busy" / "config.json").read_text() == "{}"
        assert (runs / "busy" / "endpoint").read_text() == "ipc:///elsewhere\n"
        assert set(glob.glob(os.path.join(base_dir(), "l2l-run-*"))) <= before
    finally:
        withdraw_endpoint(str(runs / "busy"))


def test_a_job_keeps_its_logs_config_and_summary_in_its_run_directory(tmp_path):
    p, s, _ = launch(tmp_path, "--workers", "2", "--steps", "6", *SMALL, "--log-every", "5")
    assert p.returncode == 0, p.stderr
    lines = [m for m in re.findall(r"^step +(\d+)/6", p.stdout, re.M)]
    assert lines == ["1", "5", "6"], p.stdout
    assert "INFO" not in p.stdout + p.stderr  # the children's chatter is in the files
    run = tmp_path / "runs" / s["run_id"]
    assert "listening on" in (run / "eps.log").read_text()
    assert (f"l2l-launch: run {s['run_id']}, logs in runs/{s['run_id']}; watch it with: "
            f"l2l-ctl status --run {s['run_id']}") in p.stderr  # it finds the socket there
    assert "hello" in (run / "eps.log").read_text().lower()
    assert {"w0.log", "w1.log", "config.json", "summary.json"} <= {f.name for f in
                                                                  run.iterdir()}
    assert not (run / "endpoint").exists()  # kept while the job ran
    assert json.loads((run / "config.json").read_text())["worker"]["steps"] == 6
    assert json.loads((run / "summary.json").read_text())["losses"] == s["losses"]
    assert "EPS update per layer" in p.stdout and f"runs/{s['run_id']}" in p.stdout
    # The recorded config runs the same job again (flags still override it).
    again, s2, _ = launch(tmp_path, "--config", str(run / "config.json"), "--steps", "7")
    assert again.returncode == 0, again.stderr
    assert s2["losses"][:6] == s["losses"] and len(s2["losses"]) == 7


def test_a_reader_that_goes_away_stops_the_output_not_the_run(tmp_path):
    """stdout closed after the first line (``| head -1``): the run goes on to its end, exits 0
    and writes its summaries; nothing is left behind."""
    summary = tmp_path / "summary.json"
    p = subprocess.Popen([sys.executable, "-m", "launch", "--endpoint",
                          f"ipc://{tmp_path}/e.sock", "--summary-json", str(summary),
                          *SMALL, "--model", "gpt", "--steps", "6", "--log-every", "1"],
                         env=ENV, cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().startswith("step     1/6")
        p.stdout.close()
        _, err = p.communicate(timeout=240)
    finally:
        p.kill()
    assert p.returncode == 0 and "Traceback" not in err, err
    s = json.loads(summary.read_text())
    assert s["ok"] and s["steps"] == 6
    assert json.loads((tmp_path / "runs" / s["run_id"] / "summary.json").read_text()) == s


def test_an_unwritable_summary_path_is_refused_before_the_run(tmp_path):
    from launch.__main__ import unwritable

    (tmp_path / "f").write_text("")
    assert unwritable(str(tmp_path / "new" / "s.json")) == ""  # its folder is made
    assert (tmp_path / "new").is_dir()
    assert unwritable(str(tmp_path / "new")) == "is a folder"
    assert unwritable(str(tmp_path / "f" / "s.json")).startswith("cannot make its folder")
    p = subprocess.run([sys.executable, "-m", "launch", "--endpoint", f"ipc://{tmp_path}/e.sock",
                        "--summary-json", str(tmp_path / "f" / "s.json"), *SMALL, "--steps",
                        "2"], env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--summary-json" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "runs").exists()  # nothing was started


def test_outputs_that_would_fail_after_training_are_refused_before_it(tmp_path):
    """An existing folder as --summary-json or as a built-in model's --save, an existing file
    as an hf: model's --save (a directory), or someone's folder: each failed after training."""
    from launch.__main__ import output_problem
    from launch.config import LaunchArgs
    from protocol import cli

    from . import hf_fixtures as fx

    model = fx.model_dir(tmp_path / "model", "llama")
    (tmp_path / "folder").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    (tmp_path / "file.jsonl").write_text("{}")

    def problem(*argv):
        return output_problem(cli.parse(LaunchArgs, list(argv), "l2l-launch"))

    folder, notes, file = (str(tmp_path / n) for n in ("folder", "notes", "file.jsonl"))
    assert problem("--summary-json", folder) == f"--summary-json {folder}: is a folder"
    assert problem("--save", folder) == f"--save {folder}: is a folder"
    hf = ["--model", f"hf:{model}"]
    assert "exists and is not a folder" in problem(*hf, "--save", file)
    assert "non-empty folder that is not a model" in problem(*hf, "--save", notes)
    assert "source directory" in problem(*hf, "--save", str(model))
    assert problem(*hf, "--save", folder) == problem(*hf, "--save", str(tmp_path / "new")) == ""


def test_a_run_that_will_replace_an_earlier_runs_checkpoints_says_so(tmp_path):
    """A new run with the --server-save of an earlier one pruned its checkpoint of step 6 at
    its own first, without a word; --load of that root (resuming it) is not warned about."""
    from launch.__main__ import earlier_checkpoints
    from launch.config import LaunchArgs
    from protocol import cli

    root = tmp_path / "ck"
    (root / "step-00000006").mkdir(parents=True)
    (root / "step-00000006" / "state.json").write_text('{"step": 6}')
    (root / "latest").write_text("step-00000006\n")

    def note(*argv):
        return earlier_checkpoints(cli.parse(LaunchArgs, ["--server-save", str(root), *argv],
                                             "l2l-launch"))

    assert note().startswith(f"--server-save {root} holds an earlier run's checkpoints (the "
                             "latest of step 6): this run's replace them")
    assert note("--load", str(root)) == note("--load", str(root / "step-00000006")) == ""
    assert note("--load", str(tmp_path / "elsewhere")) != ""
    assert earlier_checkpoints(cli.parse(LaunchArgs, ["--server-save", str(tmp_path / "new")],
                                         "l2l-launch")) == ""


def test_a_load_past_steps_says_nothing_will_train_and_a_gone_latest_is_named(tmp_path):
    """--steps is the step to train until: a step-6 checkpoint with --steps 5 ended "done: 0
    steps" without a word. A latest naming a removed folder was "checksums.json: missing"."""
    from launch.__main__ import trained_already
    from launch.config import LaunchArgs
    from protocol import cli
    from protocol.checkpoints import resolve

    root = tmp_path / "ck"
    (root / "step-00000006").mkdir(parents=True)
    (root / "step-00000006" / "state.json").write_text('{"step": 6}')
    (root / "latest").write_text("step-00000006\n")

    def note(*argv):
        return trained_already(cli.parse(LaunchArgs, list(argv), "l2l-launch"))

    assert note("--load", str(root), "--steps", "5") == (
        f"--load {root} is at step 6: --steps 5, the step to train until (not steps more), is "
        "reached already and nothing is trained; give --steps above 6")
    assert note("--load", str(root), "--steps", "7") == note("--steps", "5") == ""
    (root / "step-00000004").mkdir()
    (root / "step-00000006").rename(root / "gone")
    with pytest.raises(FileNotFoundError, match=r"latest names step-00000006, which is not "
                       r"there \(removed\?\); checkpoints there: step-00000004"):
        resolve(str(root))
