"""The CUDA paths, with real processes and real shared memory: `pytest -m cuda` (also run by
`make gpu-check`). Without a CUDA device every test here is skipped, saying why; the default
CPU run does not select them.

What a missing stream wait would break is made visible with --cuda-delay, which makes one
CUDA stream spin before its work (weight copies, a visit's kernels, copies out): results must
stay bitwise those of the serial path."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from eps_server.config import OptimizerConfig
from eps_server.optimizers import make_optimizer
from worker.config import ModelConfig
from worker.streams import read_only_registration_supported

from .baseline import assert_close, train_resident
from .helpers import SMALL
from .test_optimizers import PLAN, flat_layer, random_grads, set_grad

CUDA = torch.cuda.is_available()
WHY = (f"needs a CUDA device: torch {torch.__version__} "
       + ("was built without CUDA" if torch.version.cuda is None else "sees no GPU"))
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason=WHY)]

DEVICE = ["--device", "cuda:0"]  # every rank on the first GPU: the check needs one GPU only
SMALL_CFG = dict(layers=2, hidden=32, heads=2, seq_len=16, vocab=64, dropout=0.1)
STEPS = 4
DELAY = "2000"  # microseconds a stream spins: longer than any of these layers' kernels
# The stash paths, not kept graphs: auto would keep every block of these small models.
NO_KEEP = ("--activation-budget-gib", "0")


def train(cluster, path, workers: int, *extra: str, micro_batches: int = 2) -> dict:
    """Activation budget 0 unless ``extra`` says otherwise (NO_KEEP)."""
    cluster.run_job(workers, *SMALL, *DEVICE, "--steps", str(STEPS), "--micro-batches",
                    str(micro_batches), "--save", str(path), *NO_KEEP, *extra,
                    server_args=("--lr", "1e-3"))
    assert not cluster.leftover_regions()
    return load_file(str(path))


@pytest.mark.parametrize("workers", [1, 2])
def test_fp32_l2l_on_cuda_equals_resident_training_on_cuda(cluster, tmp_path, workers):
    """FP32 L2L with every rank on cuda:0 (overlap, device stash, 4 steps of AdamW, dropout on)
    ends within 1e-5 absolute + 1e-4 relative of the assembled model trained on the same GPU
    with gradient accumulation over the same 4 micro-batches, TF32 off. Both sides run the
    same cuBLAS kernels on the same shapes; what differs is (a) the order of fp32 additions
    (per rank, then across ranks in the EPS, against one running sum) and (b) the AdamW
    update, on the host's CPU in the EPS against CUDA's: a few ulps per step, 1e-7 relative,
    far inside the tolerance the CPU suite uses for the same comparison."""
    got = train(cluster, tmp_path / "m.safetensors", workers, micro_batches=4 // workers)
    want = train_resident(ModelConfig(model="bert", **SMALL_CFG), steps=STEPS,
                          global_micro_batches=4, batch_size=4, lr=1e-3, device="cuda:0")
    assert_close(got, want)


def test_frozen_tensors_on_cuda_train_as_the_resident_model_with_them_frozen(cluster, tmp_path):
    """--freeze on the GPU: 2 workers on cuda:0, block 1 wholly frozen (pushed as a skip),
    block 0's attention frozen (a trainable prefix): equal to the resident model trained on
    the same GPU with those parameters ``requires_grad_(False)``; the frozen tensors unchanged."""
    freeze = "blocks.1.*,blocks.0.attn.*"
    got = train(cluster, tmp_path / "m.safetensors", 2, "--freeze", freeze)
    mcfg = ModelConfig(model="bert", **SMALL_CFG, freeze=freeze)
    want = train_resident(mcfg, steps=STEPS, global_micro_batches=4, batch_size=4, lr=1e-3,
                          device="cuda:0")
    assert_close(got, want)
    start = train_resident(mcfg, steps=0, global_micro_batches=4, batch_size=4)
    for name in ("blocks.1.mlp.fc.weight", "blocks.0.attn.qkv.weight"):
        assert torch.equal(got[name], start[name]), name


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Weights after 4 steps of the default CUDA path: 2 workers on cuda:0, overlap, side
    streams, device stash, shared memory registered with the driver."""
    from .helpers import Cluster

    tmp = tmp_path_factory.mktemp("cuda-ref")
    c = Cluster(tmp)
    try:
        return train(c, tmp / "m.safetensors", 2)
    finally:
        c.close()


VARIANTS = {
    "no overlap": ["--no-overlap"],
    "slow weight copies": ["--cuda-delay", f"copy:{DELAY}"],
    "slow compute": ["--cuda-delay", f"compute:{DELAY}"],
    "slow copies out": ["--cuda-delay", f"d2h:{DELAY}"],
    "stash host": ["--stash", "host"],
    "stash host, slow copies out": ["--stash", "host", "--cuda-delay", f"d2h:{DELAY}"],
    "stash host, slow compute": ["--stash", "host", "--cuda-delay", f"compute:{DELAY}"],
    "stash host, slow copies back": ["--stash", "host", "--cuda-delay", f"copy-back:{DELAY}"],
    "stash eps": ["--stash", "eps"],
    "stash eps, slow copies out": ["--stash", "eps", "--cuda-delay", f"d2h:{DELAY}"],
    "stash eps, slow copies back": ["--stash", "eps", "--cuda-delay", f"copy-back:{DELAY}"],
    "frames": ["--transport", "frames"],
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cuda_variant_is_bitwise_the_default_path(cluster, tmp_path, reference, variant):
    """The overlapped path (prefetch into two device buffers on a side stream, pushes copied
    out on another) is bitwise the serial one, and stays so when any one stream is slowed
    down: a copy that does not wait for its buffer's release, a kernel that does not wait for
    its weights, or a push or stash entry read before its copy ends would change the result."""
    got = train(cluster, tmp_path / "m.safetensors", 2, *VARIANTS[variant])
    assert set(got) == set(reference)
    for name, want in reference.items():
        assert torch.equal(got[name], want), f"{variant}: {name} differs"


DEEP = ["--layers", "5"]  # three stashed blocks (the last one keeps its graph instead)
DEEP_VARIANTS = {
    "stash host, slow compute": ["--stash", "host", "--cuda-delay", f"compute:{DELAY}"],
    "stash host, slow copies back": ["--stash", "host", "--cuda-delay", f"copy-back:{DELAY}"],
    "stash eps, slow copies out": ["--stash", "eps", "--cuda-delay", f"d2h:{DELAY}"],
}


@pytest.fixture(scope="module")
def deep_reference(tmp_path_factory):
    """Weights after 4 steps of 5 blocks, 3 micro-batches, stash on the device."""
    from .helpers import Cluster

    tmp = tmp_path_factory.mktemp("cuda-deep-ref")
    c = Cluster(tmp)
    try:
        return train(c, tmp / "m.safetensors", 1, *DEEP, micro_batches=3)
    finally:
        c.close()


@pytest.mark.parametrize("variant", list(DEEP_VARIANTS))
def test_a_deeper_staged_stash_is_bitwise_the_device_stash(cluster, tmp_path, deep_reference,
                                                           variant):
    """Deep and wide enough that the stash's two device buffers are refilled many times per
    step while the GPU runs behind the host: each copy back must wait for its buffer's
    release and its copy out, and each read for its copy back."""
    got = train(cluster, tmp_path / "m.safetensors", 1, *DEEP, *DEEP_VARIANTS[variant],
                micro_batches=3)
    for name, want in deep_reference.items():
        assert torch.equal(got[name], want), f"{variant}: {name} differs"


def _peak(cluster, tmp_path, layers: int, stash: str) -> int:
    summary = tmp_path / f"{stash}-{layers}.json"
    cluster.run_job(1, "--layers", str(layers), "--hidden", "64", "--heads", "4",
                    "--seq-len", "32", "--vocab", "64", "--micro-batch-size", "8",
                    "--micro-batches", "4", "--threads", "1", *DEVICE, "--steps", "2",
                    "--stash", stash, "--summary-json", str(summary), *NO_KEEP)
    cluster.close()
    return json.loads(summary.read_text())["peak_memory_bytes"]


@pytest.mark.parametrize("stash", ["host", "eps", "device"])
def test_device_memory_is_flat_in_depth(cluster, tmp_path, stash):
    """Peak device memory (max_memory_allocated over the worker's life) of 4 and 64 blocks:
    with the stash on the host or in the EPS within 5%; with the stash on the device it grows
    by the stash itself, within 10%: 60 more blocks x 4 micro-batches x one fp32 boundary
    (8 x 32 x 64 x 4 bytes = 64 KiB), 15 MiB. That is over twice the growth the 5% could hide
    (the shallow worker's peak is about 71 MiB on an H200, most of it not activations)."""
    shallow, deep = (_peak(cluster, tmp_path, n, stash) for n in (4, 64))
    predicted = (64 - 4) * 4 * 8 * 32 * 64 * 4
    assert predicted > 2 * 0.05 * shallow  # growth like the device stash's would show
    if stash == "device":
        assert abs((deep - shallow) - predicted) <= 0.10 * predicted, (predicted, shallow, deep)
    else:
        assert abs(deep - shallow) <= 0.05 * shallow, (shallow, deep)


def test_the_eps_stash_outgrows_its_arena_on_cuda(cluster, tmp_path):
    """Padded text, one text per micro-batch, each a word longer than the last: entries outgrow
    the EPS stash's arena, which is replaced by a larger one (registered; the old one
    unregistered and unmapped once no copy can read it) while copies run behind the host. The
    weights are bitwise those of the device stash, and nothing is refused by the driver."""
    pytest.importorskip("transformers")
    from . import hf_fixtures as fx

    path = fx.model_dir(tmp_path / "model", "gpt2")
    lm = fx.lengthening_jsonl(tmp_path / "lm.jsonl", 13)
    got = {}
    for stash in ("device", "eps"):
        cluster.run_job(1, *SMALL, *DEVICE, "--model", f"hf:{path}", "--data", str(lm),
                        "--no-shuffle", "--micro-batch-size", "1", "--micro-batches", "3",
                        "--steps", "4", "--stash", stash, "--cuda-delay", f"d2h:{DELAY}", *NO_KEEP,
                        "--save", str(tmp_path / stash), server_args=("--lr", "1e-3"))
        assert "cudaHost" not in cluster.log(cluster.procs[-1])
        cluster.close()
        got[stash] = load_file(str(tmp_path / stash / "model.safetensors"))
    for name, want in got["device"].items():
        assert torch.equal(got["eps"][name], want), name


def test_every_shared_mapping_is_registered_with_the_driver(cluster, tmp_path):
    """On CUDA the worker page-locks every EPS mapping it reads (weights) or writes (gradient
    slots, stash arena) with cudaHostRegister; the summary counts them, and none is refused."""
    summary = tmp_path / "s.json"
    cluster.run_job(1, *SMALL, *DEVICE, "--steps", "2", "--stash", "eps", *NO_KEEP,
                    "--summary-json", str(summary))
    got = json.loads(summary.read_text())
    log = cluster.log(cluster.procs[-1])
    assert got["unpinned_regions"] == 0, log
    assert got["pinned_regions"] >= 3, got  # master (served) weights, gradient slots, arena
    assert "cudaHostRegister" not in log
    # weights mapped read-only where the GPU can register such memory, else writable
    assert read_only_registration_supported(torch.device("cuda:0")) in (True, False)


def test_a_refused_registration_is_logged_and_leaves_cuda_working(caplog):
    """Registering a range twice is refused by the driver (cudaErrorHostMemoryAlreadyRegistered):
    the refusal is logged and returned, and its pending runtime error is drained, so torch's
    next error check (after an unrelated kernel) does not raise it as its own. Likewise for
    unregistering memory that is not registered."""
    from worker.streams import cudart_paths, register_host, unregister_host

    assert cudart_paths(), "torch's CUDA runtime not found in /proc/self/maps"
    host = torch.zeros(1 << 20, dtype=torch.uint8)
    assert register_host(host, read_only=False)
    try:
        with caplog.at_level(logging.WARNING, logger="worker.streams"):
            assert not register_host(host, read_only=False)
        assert "cudaHostRegister" in caplog.text and "failed" in caplog.text
        x = torch.ones(1024, device="cuda") * 2  # would raise the pending error
        torch.cuda.synchronize()
        assert float(x.sum()) == 2048
        dev = torch.arange(1 << 20, device="cuda").to(torch.uint8)
        host.copy_(dev, non_blocking=True)  # the registered range works as pinned memory
        torch.cuda.synchronize()
        assert torch.equal(host, dev.cpu())
    finally:
        assert unregister_host(host)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="worker.streams"):
        assert not unregister_host(host)
    assert "cudaHostUnregister failed" in caplog.text
    assert float((torch.ones(8, device="cuda") + 1).sum()) == 16


def test_a_device_memory_cap_is_enforced(cluster, tmp_path):
    """--device-memory-gib caps the worker's allocator: a job that needs more than the cap
    fails with CUDA's out-of-memory error instead of using the whole GPU."""
    cluster.start_server(1)
    w = cluster.worker(0, 1, "--layers", "2", "--hidden", "1024", "--heads", "8",
                       "--seq-len", "512", "--vocab", "64", "--micro-batch-size", "64",
                       "--micro-batches", "1", *DEVICE, "--steps", "1",
                       "--device-memory-gib", "0.25")
    assert cluster.wait(w, 300) != 0
    assert "out of memory" in cluster.log(w).lower()


def test_mixed_precision_on_cuda_learns_and_tracks_fp32(tmp_path):
    """bf16 and fp16 compute on the GPU (fp32 master and AdamW in the EPS) learn the planted
    task: all three end above 90% accuracy (chance: 25%) after 80 steps. They track fp32 step
    for step at first: the mean |loss difference| over the first 10 steps stays below 0.02 for
    bf16 and 0.05 for fp16 (whose first steps may overflow and be skipped while the loss scale
    falls; not yet seen on a GPU: its run came after bf16's failure).
    Not over the whole run, as on the CPU (tests/test_precision.py): with dropout on, CUDA's
    attention takes another fused kernel for half types than for fp32 (flash vs memory-
    efficient), with its own dropout masks, so the runs soon differ like runs of different
    seeds, and on this task the loss drops a few steps sooner or later (H200: mean |loss
    difference| 0.11 over 60 steps, the first six steps within 0.006)."""
    from .test_precision import launch

    common = ["--workers", "2", "--model", "bert", "--steps", "80", *SMALL[:-4],
              "--micro-batch-size", "8", "--lr", "3e-3", *DEVICE]
    fp32 = launch(tmp_path, "fp32", *common)
    assert sum(fp32["accuracy"][-5:]) / 5 > 0.9, fp32["accuracy"]
    for precision, bound in (("bf16", 0.02), ("fp16", 0.05)):
        run = launch(tmp_path, precision, *common, "--precision", precision)
        diff = [abs(a - b) for a, b in zip(fp32["losses"], run["losses"])]
        assert sum(diff[:10]) / 10 < bound, (precision, diff)
        assert sum(run["accuracy"][-5:]) / 5 > 0.9, (precision, run["accuracy"])


@pytest.mark.parametrize("name", ["adamw", "lamb", "sgd"])
def test_an_optimizer_on_cuda_equals_the_same_on_the_cpu(name):
    """The in-process baselines of the GPU benchmarks run these optimizers on CUDA buffers
    (their step count and gradient scale must live there too). Same updates as on the CPU,
    loss scale and compute copy included, within fp32 rounding of different kernels."""
    cfg = OptimizerConfig(name=name, lr=1e-2, weight_decay=0.1, momentum=0.9)
    cpu = flat_layer(torch.bfloat16)
    gpu = [t.to("cuda") for t in cpu]
    opts = [make_optimizer(PLAN, master, compute, cfg) for master, _, compute in (cpu, gpu)]
    for t in range(4):
        g = [x * 512.0 for x in random_grads()]
        for (_, grad, _), opt in zip((cpu, gpu), opts):
            set_grad(grad, [x.to(grad.device) for x in g])
            opt.step((grad,), t, lr=1e-2, grad_scale=512.0)
    assert torch.allclose(gpu[0].cpu(), cpu[0], atol=1e-6, rtol=0)
    assert torch.equal(gpu[2], gpu[0].to(torch.bfloat16))
    assert float(opts[1].state_tensors()["step"]) == 4


def test_the_auto_activation_budget_keeps_every_block_within_a_cap(cluster, tmp_path,
                                                                  deep_reference):
    """Auto budget under --device-memory-gib 2: every block of the deep model keeps its graph
    from the second step (the budget is the cap less the first step's peak and a margin),
    the peak stays under the cap, and the weights are those of the recomputing path."""
    got = train(cluster, tmp_path / "m.safetensors", 1, *DEEP, "--activation-budget-gib", "-1",
                "--device-memory-gib", "2", "--summary-json", str(tmp_path / "w{rank}.json"),
                micro_batches=3)
    summary = json.loads((tmp_path / "w0.json").read_text())
    assert summary["kept_blocks"] == 5, summary
    assert summary["peak_memory_bytes"] <= 2 * 2**30
    assert_close(got, deep_reference, atol=1e-6, rtol=0.0)
