"""L2Lp overlap, stash placements and the copy path change nothing in the results; the trace
shows the overlap; the in-process baseline of the overlap benchmark is itself exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from protocol.shm import Region, unlink_prefix
from protocol.tensors import plan_layout
from worker.config import ModelConfig
from worker.models import build_model
from worker.stash import EpsStash
from worker.streams import Streams

from .baseline import assert_close, train_local_l2l, train_resident
from .helpers import ENV, SMALL

VARIANTS = {
    "stash eps": ["--stash", "eps"],
    "stash host": ["--stash", "host"],
    "copy weights": ["--copy-weights"],
    "no overlap": ["--no-overlap"],
    "frames": ["--transport", "frames"],
    "frames, copy": ["--transport", "frames", "--copy-weights"],
    "frames, stash eps": ["--transport", "frames", "--stash", "eps"],
    "frames, copy, stash eps": ["--transport", "frames", "--copy-weights", "--stash", "eps"],
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Weights after 4 steps of the default path: 2 workers, overlap, device stash."""
    from .helpers import Cluster

    tmp = tmp_path_factory.mktemp("ref")
    c = Cluster(tmp)
    try:
        c.run_job(2, *SMALL, "--steps", "4", "--micro-batches", "2",
                  "--save", str(tmp / "m.safetensors"))
    finally:
        c.close()
    return load_file(str(tmp / "m.safetensors"))


# Slow, as the default set covers them: frames with copied weights and frames with the EPS
# stash, each of which "frames, copy, stash eps" runs together (every single option has its own
# variant); and the host stash, which on the CPU is the device stash the reference runs
# (worker/stash.py; its CUDA branches run with fake streams in test_stash.py).
SLOW_VARIANTS = {"frames, copy", "frames, stash eps", "stash host"}


@pytest.mark.parametrize("variant", [
    pytest.param(v, marks=pytest.mark.slow) if v in SLOW_VARIANTS else v for v in VARIANTS])
def test_variant_is_bitwise_identical(cluster, tmp_path, reference, variant):
    out = tmp_path / "m.safetensors"
    cluster.run_job(2, *SMALL, "--steps", "4", "--micro-batches", "2", "--save", str(out),
                    *VARIANTS[variant])
    got = load_file(str(out))
    assert set(got) == set(reference)
    for name in reference:
        assert torch.equal(got[name], reference[name]), f"{variant}: {name} differs"
    assert not cluster.leftover_regions()  # the stash arena is the EPS's and goes with it


def test_eps_stash_lives_in_the_arena():
    name = f"l2l-test-arena-{os.getpid()}"
    unlink_prefix(name)
    regions, released = [], []

    class Source:
        def stash_arena(self, nbytes):
            regions.append(Region.create(f"{name}-{len(regions)}", nbytes))
            return regions[-1]

        def release_arena(self, region):
            released.append(region)

    try:
        stash = EpsStash(Source(), Streams(torch.device("cpu")), layers=3, micro_batches=2)
        xs = {(layer, i): torch.randn(8, 8) for layer in (1, 2, 3) for i in (0, 1)}
        for (layer, i), x in xs.items():
            kept = stash.put(layer, i, x)
            assert torch.equal(kept, x)
            assert kept.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
        assert regions[0].nbytes == 3 * 2 * 8 * 8 * 4  # sized for the whole depth at once
        for key, x in xs.items():
            assert torch.equal(stash.pop(*key), x)
        stash.clear()
        # a larger entry: a larger arena (rooms of 256 bytes), the old one let go at the end
        # of the step; an entry of another structure is refused
        big = torch.randn(9, 8)
        assert torch.equal(stash.put(1, 0, big), big) and len(regions) == 2
        assert regions[1].nbytes == 3 * 2 * 512 and not released
        assert torch.equal(stash.pop(1, 0), big)
        stash.clear()
        assert released == regions[:1]
        with pytest.raises(RuntimeError, match="varying structure"):
            stash.put(1, 0, (big, big))
    finally:
        for r in regions:
            r.unlink()
            r.close()


def test_local_baseline_is_plain_training():
    """The overlap benchmark's reference (same executor, weights local, optimizer in-process)
    trains exactly like plain PyTorch: the benchmark compares like with like."""
    cfg = ModelConfig(model="gpt", layers=2, hidden=32, heads=2, seq_len=16, vocab=64)
    got = train_local_l2l(cfg, steps=3, micro_batches=2, batch_size=4)
    want = train_resident(cfg, steps=3, global_micro_batches=2, batch_size=4)
    assert_close(got, want)


def test_trace_shows_worker_and_eps_spans(tmp_path):
    trace = tmp_path / "trace.json"
    p = subprocess.run([sys.executable, "-m", "launch", "--quiet",
                        "--runs-dir", str(tmp_path / "runs"),
                        "--workers", "2",
                        "--steps", "3", *SMALL, "--trace", str(trace),
                        "--endpoint", f"ipc://{tmp_path}/eps.sock"],
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    cats = {e["cat"] for e in spans}
    assert {"forward", "backward", "wait", "reduce", "update"} <= cats
    processes = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert processes == {"eps-server", "l2l-worker 0", "l2l-worker 1"}
    layers = len(plan_layout(build_model(ModelConfig(layers=2)).manifest()).layers)
    updates = [e for e in spans if e["cat"] == "update"]
    assert len(updates) == 3 * layers  # one eager update per layer per step
    png = tmp_path / "timeline.png"
    r = subprocess.run([sys.executable, "-m", "bench.timeline", str(trace), "--png", str(png)],
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
