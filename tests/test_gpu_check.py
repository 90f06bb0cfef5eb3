"""The GPU check where there is no GPU: the CUDA tests skip saying why, `make gpu-check` says
there is no CUDA and exits 2 without a traceback, and the GPU benchmarks' harness runs end to
end with tiny models on the CPU (its figures mean nothing; a broken harness would waste the
rare GPU session)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_parts import depth_flat, trace_split
from protocol.shm import list_regions, unlink_prefix

from .helpers import ENV, ROOT, inner_pytest

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@no_cuda
def test_cuda_tests_skip_with_a_reason():
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rs",
                        "-p", "no:cacheprovider", "tests/test_cuda.py"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert " passed" not in r.stdout and " failed" not in r.stdout, r.stdout
    skips = [line for line in r.stdout.splitlines() if line.startswith("SKIPPED")]
    assert skips and all("needs a CUDA device: torch" in line for line in skips), r.stdout


@no_cuda
def test_gpu_check_without_cuda_says_so_and_fails(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bench.gpucheck", "--out", str(tmp_path)],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "no CUDA device here" in r.stderr and "Traceback" not in r.stderr + r.stdout
    assert not (tmp_path / "gpu-check.json").exists()


def test_gpu_check_refuses_a_folder_without_wheels(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bench.gpucheck", "--out", str(tmp_path / "o"),
                        "--wheels", str(tmp_path)], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "no wheels in" in r.stderr
    assert "Traceback" not in r.stderr


def test_gpu_check_runs_only_the_parts_asked_for(tmp_path, capsys):
    """--only picks parts by name (spaces allowed); an unknown name, or nothing left to run,
    is refused before anything runs."""
    from bench.gpucheck import main

    for argv, why in ((["--only", "tests,bogus"], "unknown part(s) bogus"),
                      (["--skip-tests", "--only", "tests"], "nothing to run")):
        with pytest.raises(SystemExit) as e:
            main(["--out", str(tmp_path / "refused"), *argv])
        assert e.value.code == 2 and why in capsys.readouterr().err
    out = tmp_path / "o"
    r = subprocess.run([sys.executable, "-m", "bench.gpucheck", "--tiny", "--out", str(out),
                        "--only", " transfer , "], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads((out / "gpu-check.json").read_text())
    assert list(report["benchmarks"]) == ["transfer"]
    assert report["tests"] == {"not_run": "not asked for (--skip-tests or --only)"}


def test_trace_split_counts_nested_spans_once(tmp_path):
    """A forward visit of 10 ms holding a 4 ms wait: 6 ms forward, 4 ms wait (per step)."""
    ev = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "l2l-worker 0"}},
          {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "MainThread"}},
          {"ph": "X", "name": "data", "cat": "data", "pid": 1, "tid": 7, "ts": 0, "dur": 1000},
          {"ph": "X", "name": "F1", "cat": "forward", "pid": 1, "tid": 7, "ts": 1000,
           "dur": 10000},
          {"ph": "X", "name": "wait L1", "cat": "wait", "pid": 1, "tid": 7, "ts": 2000,
           "dur": 4000},
          {"ph": "X", "name": "copy L2", "cat": "h2d", "pid": 1, "tid": 8, "ts": 2000,
           "dur": 4000}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    assert trace_split(str(path)) == pytest.approx({"data": 0.001, "forward": 0.006,
                                                    "wait": 0.004})
    # A second step, 1 ms data and a 2 ms forward: skipping the first (warm-up) splits it alone.
    ev += [{"ph": "X", "name": "data", "cat": "data", "pid": 1, "tid": 7, "ts": 20000,
            "dur": 1000},
           {"ph": "X", "name": "F1", "cat": "forward", "pid": 1, "tid": 7, "ts": 21000,
            "dur": 2000}]
    path.write_text(json.dumps({"traceEvents": ev}))
    assert trace_split(str(path)) == pytest.approx({"data": 0.001, "forward": 0.004,
                                                    "wait": 0.002})
    assert trace_split(str(path), skip=1) == pytest.approx({"data": 0.001, "forward": 0.002})
    assert depth_flat({24: 100, 384: 104, 48: 101}) == pytest.approx(1.04)


def peer_trains_the_resident_model(name: str) -> None:
    """Peer ``name`` (fp32, on the CPU) takes the resident model's steps: the same data,
    dropout and AdamW parameter groups, so the same losses to rounding (3 steps, the last two
    after updates). Its samples/s then compare like with like. The learning rate and weight
    decay are large enough that decaying the vectors too moves the losses about 900 times
    the tolerance (with the benchmark's 1e-4 and 0.01 it would not show). Summed or averaged
    micro-batch gradients would not show either way: AdamW is blind to their scale."""
    from bench.gpu import TINY
    from bench.peers import PEERS
    from worker.config import ModelConfig

    from .baseline import train_resident

    mcfg = ModelConfig(**TINY, seq_len=16, dropout=0.1)
    lr, wd = 1e-2, 0.5

    def resident(weight_decay: float) -> list[float]:
        losses: list[float] = []
        train_resident(mcfg, steps=3, global_micro_batches=2, batch_size=2, lr=lr,
                       weight_decay=weight_decay, losses=losses)
        return losses

    want = resident(wd)
    assert resident(0.0) != pytest.approx(want, rel=1e-5)  # the decay shows in the losses
    r = PEERS[name](mcfg, micro_batches=2, batch_size=2, steps=2, warmup=1, device="cpu",
                    precision="fp32", lr=lr, weight_decay=wd)
    assert r["samples_per_sec"] > 0
    assert r["losses"] == pytest.approx(want, rel=1e-6), (r["losses"], want)


def test_in_process_baselines_of_the_gpu_benchmarks_run_on_cpu():
    """The resident baseline's batch search and FSDP2 in one process (the peers' runner) work
    with a tiny model; the jobs of every piece run in the slow test below."""
    from bench.gpu import TINY
    from bench.gpu_parts import resident_fit
    from worker.config import ModelConfig

    mcfg = ModelConfig(**TINY, seq_len=16, dropout=0.1)
    fit = resident_fit(mcfg, "fp32", "cpu", 0, steps=1, warmup=1, limit=2)
    assert fit["batch"] == 2 and fit["samples_per_sec"] > 0 and fit["peak_bytes"] > 0
    for name in ("resident", "fsdp2", "fsdp2-noac", "fsdp2-hostacc"):
        peer_trains_the_resident_model(name)


def test_an_l2l_job_out_of_device_memory_is_tried_again_at_half_the_micro_batch():
    """The paper table's L2L fit: a job that runs out of device memory is run again with half
    the micro-batch until one fits, then once at the midpoint back up; any other failure is
    raised at once."""
    from bench.gpu_parts import l2l_fit
    from worker.config import ModelConfig

    def fitting(largest: int, tried: list):
        def run(mbs: int) -> dict:
            tried.append(mbs)
            if mbs > largest:
                raise RuntimeError("l2l-launch failed (1):\ntorch.OutOfMemoryError: CUDA out "
                                   "of memory. Tried to allocate 2.22 GiB.")
            return {"workers": [{"step_seconds": [9.0, 0.5, 0.5], "peak_memory_bytes": mbs}]}
        return run

    for largest, want_tried, want in ((2, [8, 4, 2, 3], 2), (6, [8, 4, 6], 6), (9, [8], 8)):
        tried: list = []  # 8: the estimate without a CUDA memory cap
        r = l2l_fit(fitting(largest, tried), ModelConfig(), "fp32", 4, "cpu", 0, warmup=1,
                    tiny=False)
        assert tried == want_tried
        assert r == {"batch": want, "step_seconds": 0.5, "samples_per_sec": 4 * want / 0.5,
                     "peak_bytes": want}

    def broken(mbs: int) -> dict:
        raise RuntimeError("l2l-launch failed (1): worker 0 exited")

    with pytest.raises(RuntimeError, match="worker 0 exited"):
        l2l_fit(broken, ModelConfig(), "fp32", 4, "cpu", 0, warmup=1, tiny=False)


def test_the_l2l_micro_batch_estimate_measures_the_hungriest_layer_alone():
    """Bytes per sample come from one layer at a time (what a visit holds): a block's saved
    activations, at least its qkv and FFN outputs, whatever the vocabulary (the embedding's
    gradient, set by the vocabulary, is allocated once and must not dilute the slope), and
    half types take less."""
    from bench.gpu_parts import layer_bytes
    from worker.config import ModelConfig

    def per_sample(vocab: int, precision: str = "fp32") -> float:
        m = ModelConfig(model="bert", layers=3, hidden=64, heads=4, ffn=256, vocab=vocab,
                        classes=2, seq_len=32, dropout=0.1)
        return max(slope for slope, _ in layer_bytes(m, precision, "cpu", sizes=(2, 6)))

    small, large = per_sample(128), per_sample(4096)
    assert small == large
    assert small >= 32 * (3 * 64 + 256) * 4
    assert per_sample(128, "bf16") < 0.8 * small


def test_a_paper_configuration_that_fails_costs_its_row_only(monkeypatch):
    """One L2L configuration failing leaves the others' rows and targets; the piece reports
    which one failed (the check counts that as broken). The rows at a fixed micro-batch run
    their job at that size, without the fit, and have their own u target."""
    import argparse

    from bench import gpu

    def resident(mcfg, precision, *args, **kw) -> dict:
        return {"batch": 8, "step_seconds": 0.8, "samples_per_sec": 10.0, "peak_bytes": 1}

    def fit(run, mcfg, precision, u, *args, **kw) -> dict:
        if precision == "fp32" and u == 4:
            raise RuntimeError("l2l-launch failed (1): CUDA out of memory")
        return {"batch": 4, "step_seconds": 0.1, "samples_per_sec": 20.0 * u, "peak_bytes": 1}

    jobs = []

    def job(a, m, *, seq, mbs, u, precision="fp32", extra=(), steps=None) -> dict:
        jobs.append((precision, u, mbs))
        if precision == "bf16" and u == 1:
            raise RuntimeError("l2l-launch failed (1): worker 0 exited")
        return {"workers": [{"step_seconds": [9.0, 0.4, 0.4], "peak_memory_bytes": 1}]}

    monkeypatch.setattr(gpu, "resident_fit", resident)
    monkeypatch.setattr(gpu, "l2l_fit", fit)
    monkeypatch.setattr(gpu, "job", job)
    p = argparse.ArgumentParser()
    gpu.add_args(p)
    r = gpu.bench_paper(p.parse_args(["--tiny", "--device", "cpu", "--u", "1,4", "--mbs",
                                      "0,2"]))
    assert r["error"] == "failed: T=32 fp32_u4, T=32 bf16_u1_mbs2"
    assert [(t["name"], t["value"]) for t in r["targets"]] == [
        ("T=32: CMP / resident fp32 samples/s", 8.0),
        ("T=32: bf16 u=4 / u=1 samples/s (largest micro-batch)", 4.0),
        ("T=32: fp32 u=4 / u=1 samples/s (micro-batch 2)", 4.0)]
    assert jobs == [("bf16", 1, 2), ("bf16", 4, 2), ("fp32", 1, 2), ("fp32", 4, 2)]
    assert set(r["by_seq"][32]["l2l"]) == {"fp32_u1", "bf16_u1", "bf16_u4", "bf16_u4_mbs2",
                                           "fp32_u1_mbs2", "fp32_u4_mbs2"}
    assert r["by_seq"][32]["l2l"]["fp32_u4_mbs2"]["samples_per_sec"] == 4 * 2 / 0.4
    assert "FAILED" in r["table"] and "CMP bf16 (B fixed)" in r["table"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepspeed", "deepspeed-offload"])
def test_deepspeed_offload_trains_the_resident_model_on_cpu(monkeypatch, name):
    """DeepSpeed's runner on its CPU accelerator: the ZeRO-3 (and ZeRO-2 optimizer offload)
    configurations, engine calls and CPU Adam the GPU check uses (there in bf16, its offload
    from the GPU). Its first use compiles DeepSpeed's CPU ops (about 2 minutes on 2 cores;
    cached afterwards)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # also where there is a GPU
    pytest.importorskip("deepspeed", reason="make test-slow installs DeepSpeed")
    def env() -> dict:  # (but torch's cache directory, set on first use by the reference)
        return {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}

    before = env()
    peer_trains_the_resident_model(name)
    assert env() == before  # its torch.distributed variables and DeepSpeed's are gone


@pytest.mark.exclusive  # (it looks for any job's regions and bench processes left behind)
def test_a_piece_stopped_by_the_budget_keeps_its_rows_and_leaves_nothing_behind(tmp_path):
    """The budget's SIGINT reaches the piece and its L2L job: the piece writes what it measured
    (rows of the paper table) and the job's processes and shared memory are gone."""
    from bench.gpucheck import Check, run_piece

    before = set(list_regions("l2l-"))
    check = Check(tmp_path, tmp_path, {})
    env = dict(ENV, PYTHONPATH=str(ROOT))
    data = run_piece(check, env, "paper", "paper", ["--tiny", "--device", "cpu", "--steps", "1",
                                                    "--warmup", "1", "--u", "1,2,3,4,5,6,7,8",
                                                    "--mbs", "0"],
                     timeout=20)
    assert "stopped" in data and "error" not in data, data
    # the resident rows come within seconds; the 16 L2L jobs (3 processes each) take far longer
    assert "STOPPED" in data["table"] and 1 <= len(data["rows"]) < 18, data
    log = (tmp_path / "gpu-check.log").read_text()
    assert "bench-paper: exit" in log and "(stopped: time budget)" in log
    # (l2l-t...: the test clusters of a run beside this one, if any; l2l-launch's ids are hex)
    assert {r for r in set(list_regions("l2l-")) - before if not r.startswith("l2l-t")} == set()
    assert not _l2l_processes(), _l2l_processes()


def _l2l_processes() -> list[str]:
    found = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "l2l-bench-" in cmd:
            found.append(cmd)
    return found


def test_beyond_is_the_shallowest_llama_the_resident_model_cannot_hold():
    """--hf-layers beyond: the fewest layers whose resident training outgrows the device by
    15% (one fewer does not), refused where the offloading peers' host memory cannot hold
    them."""
    from bench.gpu_models import RESIDENT_BASE, RESIDENT_PER_LAYER, layers_beyond

    need = lambda n: RESIDENT_BASE + n * RESIDENT_PER_LAYER  # noqa: E731
    for device_gib in (24, 80, 141):
        device = device_gib * 2**30
        n = layers_beyond(device, 1 << 40)
        assert need(n) >= 1.15 * device > need(n - 1), (device_gib, n)
    assert layers_beyond(80 * 2**30, 125 * 2**30) < layers_beyond(141 * 2**30, 125 * 2**30)
    with pytest.raises(SystemExit, match="host memory holds"):
        layers_beyond(141 * 2**30, 32 * 2**30)


@pytest.mark.slow
def test_gpu_check_harness_end_to_end_on_cpu(tmp_path):
    """`--tiny`: every part with tiny models on the CPU, as on a GPU machine: the CUDA tests
    (all skip here), then every benchmark piece (the paper table's resident batch search and
    L2L jobs, memory by depth, the overhead against the local loop, MFU from a traced job,
    FSDP2 and, where installed (make test-slow), DeepSpeed beside an L2L job). OUT gets three
    files."""
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "bench.gpucheck", "--tiny", "--out", str(out),
                        "--budget", "900", "--share", "engines=150"],  # its tiny run: ~40 s
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.json", "gpu-check.log",
                                                     "gpu-check.md"]
    report = json.loads((out / "gpu-check.json").read_text())
    tests, pieces = report["tests"], report["benchmarks"]
    assert tests["skipped"] >= 10 and tests["passed"] == tests["failed"] == 0, tests
    for name, piece in pieces.items():
        assert "error" not in piece and "stopped" not in piece and "not_run" not in piece, \
            (name, piece)
    peers = {"fsdp2": ["resident", "fsdp2", "fsdp2-noac"]}
    if importlib.util.find_spec("deepspeed") is None:
        assert "not installed" in pieces["deepspeed"]["skipped"]
    else:
        peers["deepspeed"] = ["deepspeed", "deepspeed-offload"]
    for piece, names in peers.items():  # fp32 here: the peers and L2L take the same steps
        systems = pieces[piece]["systems"]
        for name in names:
            assert systems[name]["samples_per_sec"] > 0, systems
            assert systems[name]["losses"] == pytest.approx(systems["l2l"]["losses"],
                                                            rel=1e-5)
    ds = "deepspeed" in peers
    for piece, names in (("hfpeers", ["l2l_u2_budget0", "resident", "fsdp2", "fsdp2-noac",
                                      *["deepspeed-offload"] * ds]),  # a Hugging Face Llama
                         ("hfbig", ["resident", "fsdp2", *["deepspeed"] * ds]),
                         ("hfmoe", ["resident", "fsdp2", *["deepspeed-offload"] * ds])):
        systems = pieces[piece]["systems"]
        for name in names:
            assert systems[name]["losses"] == pytest.approx(
                systems["l2l_u2_auto"]["losses"], rel=1e-5), (piece, name)
    moe = pieces["hfmoe"]  # OLMoE's: 8 experts, 2 per token, in the tiny shape
    assert 0 < moe["active_params"] < moe["params"] and "OLMoE" in moe["table"]
    assert {"forward", "backward"} <= set(pieces["mfu"]["time_split"])
    assert pieces["transfer"]["skipped"] == "no CUDA"
    rows = pieces["paper"]["by_seq"]["32"]
    assert rows["resident"]["fp32"]["batch"] >= 1 and rows["l2l"]["bf16_u4"]["batch"] >= 1
    assert set(pieces["depth"]["peak_bytes"]) == {"2", "4", "8"}
    assert pieces["overhead"]["step_seconds"]["l2lp"] > 0
    assert min(m["gb_per_s"] for m in pieces["engines"]["modes"].values()) > 0
    llama = pieces["llama"]
    assert llama["params"] > 0 and 8 < llama["eps"]["bytes_per_param"] < 40, llama
    assert min(pieces["overhead"]["waits"].values()) >= 0
    md = (out / "gpu-check.md").read_text()
    assert "## paper" in md and "CMP bf16" in md


LEAKY = """
import time
from protocol.shm import Region

def test_holds_a_region_while_the_other_process_ends():
    r = Region.create("l2l-xdisttest-{pid}-held", 64)
    time.sleep(3)
    r.unlink()
    r.close()

def test_leaks_a_region():
    Region.create("l2l-xdisttest-{pid}-leaked", 64)
"""


@pytest.mark.exclusive  # (an outer test's regions would be this run's leaks)
def test_under_xdist_the_whole_run_is_checked_for_leaked_shared_memory(tmp_path):
    """With pytest-xdist (make test; the GPU check's CUDA tests) a process cannot
    tell another's live regions from its own leaks: the controller checks the whole run, so a
    region one process holds while the other ends is no leak, and one never unlinked is."""
    pytest.importorskip("xdist")
    name = f"l2l-xdisttest-{os.getpid()}"
    (tmp_path / "test_leaky.py").write_text(LEAKY.format(pid=os.getpid()))
    try:
        r = inner_pytest(tmp_path / "test_leaky.py")
        assert "2 passed" in r.stdout and r.returncode == 1, r.stdout + r.stderr
        assert f"shared memory leaked by the tests: ['{name}-leaked']" in r.stdout, r.stdout
    finally:
        unlink_prefix(name)
