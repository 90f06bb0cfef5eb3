"""The GPU check where there is no GPU: the CUDA tests skip saying why, `make gpu-check` says
there is no CUDA and exits 2 without a traceback, and the GPU benchmarks' harness runs end to
end with tiny models on the CPU (its figures mean nothing; a broken harness would waste the
rare GPU session)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from bench.gpu_parts import depth_flat, trace_split

from .helpers import ENV, ROOT

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
    assert depth_flat({24: 100, 384: 104, 48: 101}) == pytest.approx(1.04)


def _tiny(tmp_path, only: str, *extra: str) -> dict:
    out = tmp_path / "gpu.json"
    r = subprocess.run([sys.executable, "-m", "bench", "gpu", "--tiny", "--device", "cpu",
                        "--only", only, "--steps", "1", "--warmup", "1", "--json", str(out),
                        *extra], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=600)
    assert out.exists(), r.stdout + r.stderr
    pieces = json.loads(out.read_text())["pieces"]
    for name, piece in pieces.items():
        assert "error" not in piece, (name, piece["error"])
    return pieces


def test_in_process_baselines_of_the_gpu_benchmarks_run_on_cpu():
    """The resident baseline's batch search and FSDP2 in one process (the peers' runner) work
    with a tiny model; the jobs of every piece run in the slow test below."""
    from bench.gpu import TINY
    from bench.gpu_parts import resident_fit
    from bench.peers import PEERS
    from worker.config import ModelConfig

    mcfg = ModelConfig(**TINY, seq_len=16, dropout=0.1)
    fit = resident_fit(mcfg, "fp32", "cpu", 0, steps=1, warmup=1, limit=2)
    assert fit["batch"] == 2 and fit["samples_per_sec"] > 0 and fit["peak_bytes"] > 0
    r = PEERS["fsdp2"](mcfg, micro_batches=2, batch_size=2, steps=1, warmup=1, device="cpu",
                       precision="fp32")
    assert r["samples_per_sec"] > 0
    with pytest.raises(RuntimeError, match="needs CUDA"):
        PEERS["deepspeed"](mcfg, micro_batches=2, batch_size=2, steps=1, warmup=1,
                           device="cpu", precision="fp32")


@pytest.mark.slow
def test_gpu_benchmark_harness_all_pieces_on_cpu(tmp_path):
    """Every piece with tiny models: the paper table (resident batch search, L2L jobs per
    precision and u), memory by depth, the overhead against the local loop, MFU (a traced
    job) and the peers (an L2L job beside FSDP2)."""
    pieces = _tiny(tmp_path, "transfer,overhead,paper,depth,mfu,peers", "--u", "1,2")
    assert pieces["peers"]["systems"]["fsdp2"]["samples_per_sec"] > 0
    assert "needs CUDA" in pieces["peers"]["systems"]["deepspeed"]["error"]
    assert {"forward", "backward"} <= set(pieces["mfu"]["time_split"])
    assert pieces["transfer"]["skipped"] == "no CUDA"
    rows = pieces["paper"]["by_seq"]["32"]
    assert rows["resident"]["fp32"]["batch"] >= 1 and rows["l2l"]["bf16_u2"]["batch"] >= 1
    assert set(pieces["depth"]["peak_bytes"]) == {"2", "4", "8"}
    assert pieces["overhead"]["step_seconds"]["l2lp"] > 0
