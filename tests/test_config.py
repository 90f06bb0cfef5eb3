"""One source for every option: the config dataclasses generate the CLIs and read config files;
events are typed; the package boundaries hold (the EPS imports no model code, its core no I/O)."""

from __future__ import annotations

import ast
import dataclasses
import json
from dataclasses import replace
from pathlib import Path

import pytest

from eps_server.config import ServerArgs, ServerConfig
from launch.config import PER_SERVER, PER_WORKER, LaunchArgs, LaunchConfig
from protocol import cli, events
from worker.config import DataConfig, ModelConfig, WorkerArgs, WorkerConfig

from .helpers import ROOT

ROOTS = {"eps-server": ServerArgs, "l2l-worker": WorkerArgs, "l2l-launch": LaunchArgs}


@pytest.mark.parametrize("prog", list(ROOTS))
def test_every_option_has_help_with_its_default(prog):
    opts = cli.options(ROOTS[prog])
    assert opts
    for opt in opts:
        assert opt.help, f"{prog} {opt.flag}: no docstring under {'.'.join(opt.path)}"
    text = cli.parser(ROOTS[prog], prog).format_help()
    assert text.count("(default:") == len(opts)


def _leaves(cls, path=(), omit=()):
    out = set()
    for f in dataclasses.fields(cls):
        if f.name in omit:
            continue
        tp = cli._hints(cls)[f.name]
        out |= _leaves(tp, (*path, f.name)) if dataclasses.is_dataclass(tp) else {(*path, f.name)}
    return out


def test_the_launcher_defines_no_option_of_its_own_twice():
    """l2l-launch's options are its LaunchConfig plus the worker's and server's fields (minus
    those it sets per child): the same definitions, the same flags."""
    launch = {o.path: o.flag for o in cli.options(LaunchArgs)}
    expected = (_leaves(LaunchConfig, ("launch",)) | _leaves(ModelConfig, ("model",))
                | _leaves(DataConfig, ("data",)) | _leaves(WorkerConfig, ("worker",), PER_WORKER)
                | _leaves(ServerConfig, ("server",), PER_SERVER))
    assert set(launch) == expected
    shared = 0
    for root in (ServerArgs, WorkerArgs):
        for opt in cli.options(root):
            if opt.path in launch:
                assert launch[opt.path] == opt.flag
                shared += 1
    assert shared == len(launch) - len(_leaves(LaunchConfig))


def test_config_file_then_flags(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("model: {layers: 3, hidden: 32}\nserver: {optimizer: {lr: 0.5}}\n"
                    "launch: {workers: 2}\n")
    args = cli.parse(LaunchArgs, ["--config", str(path), "--layers", "5", "--no-overlap"], "t")
    assert (args.model.layers, args.model.hidden, args.server.optimizer.lr) == (5, 32, 0.5)
    assert args.launch.workers == 2 and args.worker.overlap is False
    assert args.model.ffn == 4 * 32  # the dataclass's own defaults still apply


def test_yaml_reads_exponents_as_numbers(tmp_path):
    """deploy/README.md's own `optimizer: {lr: 1e-4}` was refused: YAML 1.1 (PyYAML) reads a
    float without a dot as a string. Read as YAML 1.2 does; a quoted one stays a string."""
    path = tmp_path / "job.yaml"
    path.write_text("server: {precision: bf16, optimizer: {lr: 1e-4, eps: 1E-8, "
                    "weight_decay: +2.5e-2}}\nworker: {steps: 3}\nmodel: {hidden: 32}\n")
    args = cli.parse(LaunchArgs, ["--config", str(path)], "t")
    opt = args.server.optimizer
    assert (opt.lr, opt.eps, opt.weight_decay) == (1e-4, 1e-8, 0.025)
    assert cli.load_file(str(path))["model"]["hidden"] == 32
    path.write_text('server: {optimizer: {lr: "1e-4"}}\n')
    with pytest.raises(SystemExit):
        cli.parse(LaunchArgs, ["--config", str(path)], "t")


@pytest.mark.parametrize("content, message", [
    ({"model": {"hiden": 3}}, "model.hiden: unknown key; did you mean hidden?"),
    ({"model": {"layers": "three"}}, "model.layers: expected int"),
    ({"server": {"optimizer": {"lr": "fast"}}}, "server.optimizer.lr: expected float"),
    ({"worker": {"rank": 1}}, "worker.rank: unknown key"),  # set per child by the launcher
    ({"worker": {"stash": "disk"}}, "worker.stash: must be one of"),
    ({"worker": {"device": "gpu"}}, "device must be cpu, cuda or cuda:K, got 'gpu'"),
    ({"model": {"hidden": 30, "heads": 4}}, "divisible"),
    ({"modle": {}}, "modle: unknown key"),
])
def test_bad_config_is_refused_with_the_keys_path(tmp_path, capsys, content, message):
    path = tmp_path / "job.json"
    path.write_text(json.dumps(content))
    with pytest.raises(SystemExit) as e:
        cli.parse(LaunchArgs, ["--config", str(path)], "l2l-launch")
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["--lyers", "3"], "unrecognized arguments: --lyers 3; did you mean --layers?"),
    (["--lr=0.1", "--stesp", "2", "--wamrup-steps=1"],
     "did you mean --steps for --stesp, --warmup-steps for --wamrup-steps?"),
    (["--zzz"], "unrecognized arguments: --zzz"),
    (["--layers", "x"], "argument --layers: invalid int value: 'x'"),
])
def test_a_usage_error_is_one_line_first_with_the_nearest_flag(capsys, argv, said):
    """Not ~55 lines of usage above the error: the error, then where the options are."""
    with pytest.raises(SystemExit) as e:
        cli.parse(LaunchArgs, argv, "l2l-launch")
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("l2l-launch: error: ") and err[0].endswith(said), err
    assert err[1:] == ["(options: l2l-launch --help)"]


def test_an_hf_model_is_not_saved_to_a_safetensors_name(capsys):
    """An hf: model saves a save_pretrained directory: --save m.safetensors quietly made a
    directory of that name; refused before training, and --help says what each kind writes."""
    for root, prog in ((LaunchArgs, "l2l-launch"), (WorkerArgs, "l2l-worker")):
        with pytest.raises(SystemExit) as e:
            cli.parse(root, ["--model", "hf:m", "--save", "out/m.safetensors"], prog)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--save out/m.safetensors: a Hugging Face model (--model hf:...) is saved as a " \
               "save_pretrained directory" in err and "e.g. --save out/m\n" in err, err
        assert cli.parse(root, ["--model", "hf:m", "--save", "out/m"], prog).model.model == "hf:m"
        assert cli.parse(root, ["--save", "m.safetensors"], prog)  # a built-in model: a file
        text = " ".join(cli.parser(root, prog).format_help().split())
        assert "an hf: model as a save_pretrained directory" in text, text


def test_typed_configs_round_trip(tmp_path):
    """What the launcher writes for a child is what the child reads back."""
    args = WorkerArgs(worker=WorkerConfig(rank=1, world_size=2, stash="eps", overlap=False),
                      model=ModelConfig(model="gpt", layers=3, tie_embeddings=True),
                      data=DataConfig(task="markov"))
    cli.write_file(args, str(tmp_path / "w1.json"))
    assert cli.parse(WorkerArgs, ["--config", str(tmp_path / "w1.json")], "t") == args
    # Values the config derives are saved as given: a replay with another width derives anew.
    assert json.loads((tmp_path / "w1.json").read_text())["model"]["ffn"] == 0
    wider = cli.parse(WorkerArgs, ["--config", str(tmp_path / "w1.json"), "--hidden", "128"], "t")
    assert (wider.model.ffn, wider.model.classes) == (512, 4)
    fixed = replace(args, model=ModelConfig(model="gpt", ffn=100, classes=3))
    cli.write_file(fixed, str(tmp_path / "w2.json"))
    again = cli.parse(WorkerArgs, ["--config", str(tmp_path / "w2.json"), "--hidden", "128"], "t")
    assert (again.model.ffn, again.model.classes) == (100, 3)  # given values stay


def test_evaluation_every_n_steps_needs_evaluation_data():
    """--eval-every alone was silently ignored (no data: no evaluation)."""
    with pytest.raises(ValueError, match="--eval-every needs --eval-data"):
        DataConfig(eval_every=2)
    assert DataConfig(eval_every=2, eval_data="e.txt").eval_every == 2


def test_events_are_typed_and_checked(tmp_path):
    ev = events.StepDone(rank=1, step=3, loss=0.5, correct=7, count=8, samples=8, seconds=0.1)
    assert events.decode(events.encode(ev)) == ev
    for ev in (events.Joined(rank=1, pid=2, step=3, pushed=1, rejoined=True),
               events.PeerLost(rank=1, pid=2, silent=2.5)):  # every kind of field
        assert events.decode(events.encode(ev)) == ev
    for bad in ['{"event": "step", "rank": 1}', '{"event": "nope"}', "[1, 2]",
                '{"event": "joined", "rank": 1, "pid": 2, "step": 3, "pushed": 1, '
                '"rejoined": 1}',
                '{"event": "ready", "endpoint": "e", "run_id": "r", "pid": "12"}', "not json",
                '{"event": "ready", "endpoint": "e", "run_id": "r", "pid": 1, "extra": 0}']:
        with pytest.raises(ValueError):
            events.decode(bad)
    # a field with a default may be left out (an older sender): it takes its default
    assert events.decode('{"event": "ready", "endpoint": "e", "run_id": "r", "pid": 1}') == \
        events.Ready(endpoint="e", run_id="r", pid=1, step=0)
    w = events.EventWriter(str(tmp_path / "ev"))
    w.emit(events.Ready(endpoint="ipc:///x", run_id="r", pid=1))
    w.close()
    assert events.read_events(str(tmp_path / "ev")) == [
        events.Ready(endpoint="ipc:///x", run_id="r", pid=1)]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_package_boundaries():
    """protocol/ imports nothing else of ours; the EPS never imports model code (worker/,
    transformers); the EPS core (everything but the shell and the entry point) does no I/O."""
    for f in (ROOT / "protocol").glob("*.py"):
        assert not _imports(f) & {"eps_server", "worker", "launch", "bench"}, f.name
    for f in (ROOT / "eps_server").glob("*.py"):
        assert not _imports(f) & {"worker", "launch", "bench", "transformers"}, f.name
        if f.name not in ("server.py", "__main__.py"):
            assert not _imports(f) & {"zmq", "asyncio", "uvloop"}, f.name
    for f in (ROOT / "worker").rglob("*.py"):
        assert not _imports(f) & {"eps_server", "launch"}, f.name


def test_no_module_over_400_lines():
    for package in ("protocol", "eps_server", "worker", "launch", "bench", "l2l"):
        for f in (ROOT / package).rglob("*.py"):
            assert len(f.read_text().splitlines()) <= 400, f
