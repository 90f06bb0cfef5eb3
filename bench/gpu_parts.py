"""Pieces of the GPU benchmarks (bench/gpu.py): the resident baseline at the largest batch
that fits under a device-memory cap, the largest L2L micro-batch, copy bandwidths, and the
worker's time by category from its trace. On a CPU they run too (tiny models, no cap), so the
harness is tested where there is no GPU."""

from __future__ import annotations

import contextlib
import gc
import json
import os
from collections import defaultdict
from dataclasses import replace

import torch

from protocol.tensors import plan_layout
from worker.config import ModelConfig
from worker.data import Sharder, build_task
from worker.memory import private_rss
from worker.models import build_model
from worker.models.base import optimizer_groups

from .common import median, steady_step_seconds, sync, timed_steps

# Host bytes per parameter in the EPS with bf16 compute and AdamW: fp32 master, m and v, the
# bf16 copy served to workers (gradient slots and stash are per worker and small).
MEM = 4 + 4 + 4 + 2
# Of which in shared memory: the master and the bf16 copy (and a retained copy, if kept).
SHM = 4 + 2 + 2


@contextlib.contextmanager
def capped(device: torch.device, cap: int):
    """The caching allocator of this process refuses more than ``cap`` bytes (0: no cap)."""
    cuda = device.type == "cuda"
    if cuda and cap:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    try:
        yield
    finally:
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(1.0, device)


def peak_now(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else private_rss()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def resident_fit(mcfg: ModelConfig, precision: str, device: str, cap: int, *, steps: int,
                 warmup: int, limit: int) -> dict:
    """The assembled model trained as usual (fused AdamW; bf16: autocast, fp32 weights) at the
    largest batch that fits under ``cap``: doubling until out of memory, then two bisections;
    then timed at that batch."""
    dev = torch.device(device)
    with capped(dev, cap):
        net = build_model(mcfg).assemble().train().to(dev)
        opt = torch.optim.AdamW(optimizer_groups(net.named_parameters(), 0.01), lr=1e-4,
                                fused=True)
        task = build_task(build_model(mcfg))

        def stepper(batch_size: int):
            sharder = Sharder(task, batch_size, 1)

            def step(i: int) -> None:
                opt.zero_grad(set_to_none=True)
                batch = sharder.batches(i, range(1))[0].to(dev)
                with torch.autocast(dev.type, dtype=torch.bfloat16,
                                    enabled=precision == "bf16"):
                    loss, _ = net(batch, rng=(mcfg.seed, i, 0))
                loss.backward()
                opt.step()
            return step

        def fits(batch_size: int) -> bool:
            ok = True
            try:
                timed_steps(stepper(batch_size), 1, 1, dev)
            except torch.OutOfMemoryError:
                ok = False
            opt.zero_grad(set_to_none=True)
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            return ok

        best, fail = 0, 0
        b = 1
        while b <= limit:
            if not fits(b):
                fail = b
                break
            best, b = b, 2 * b
        for _ in range(2 if best and fail else 0):
            mid = (best + fail) // 2
            if mid in (best, fail):
                break
            best, fail = (mid, fail) if fits(mid) else (best, mid)
        if not best:
            raise RuntimeError(f"resident {precision}: not even one sample fits in "
                               f"{cap / 2**30:.1f} GiB")
        reset_peak(dev)
        seconds = timed_steps(stepper(best), steps, warmup, dev)
        peak = peak_now(dev)
    return {"batch": best, "step_seconds": seconds, "samples_per_sec": best / seconds,
            "peak_bytes": int(peak)}


def l2l_micro_batch(mcfg: ModelConfig, precision: str, u: int, device: str, cap: int) -> int:
    """An estimate of the largest L2L micro-batch under ``cap``: for each layer kind, its bytes
    per sample (forward + backward, in the compute dtype; ``layer_bytes``) times u + 1 (the
    last block keeps u micro-batches' graphs; one more is recomputed) plus its fixed bytes,
    two weight buffers and two fp32 gradient slots of the largest layer, within 85% of the
    cap; the smallest over the kinds. At least four boundary activations a sample, whatever
    is measured."""
    dev = torch.device(device)
    if dev.type != "cuda" or not cap:
        return 8
    itemsize = compute_dtype(precision).itemsize
    boundary = mcfg.seq_len * mcfg.hidden * itemsize
    largest = plan_layout(build_model(mcfg).manifest()).max_layer_numel
    room = 0.85 * cap - largest * (2 * itemsize + 2 * 4)
    return max(1, min(int((room - fixed) // ((u + 1) * max(per_sample, 4 * boundary)))
                      for per_sample, fixed in layer_bytes(mcfg, precision, device)))


def compute_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32


def layer_bytes(mcfg: ModelConfig, precision: str, device: str,
                sizes: tuple[int, int] = (8, 32)) -> list[tuple[float, float]]:
    """[(bytes per sample, bytes at no samples)] of each layer kind (the embedding, a block,
    the head), each run forward and backward alone as the executor runs a layer: the slope
    between two micro-batch sizes of the bytes autograd saves for backward and, on CUDA, of
    the peak allocated; the larger of the two.

    Each layer alone, not a whole one-block model: there the embedding's and the head's weight
    gradients, allocated late in backward when the activations are freed, set the peak at a
    few samples, and the slope came out near nothing (on an H200, 3,320 samples estimated for
    BERT-Large fp32 where 830 fit and 1,660 did not). A first pass at the smaller size
    allocates what is allocated once (cuBLAS's workspace)."""
    dev = torch.device(device)
    layered = build_model(replace(mcfg, layers=1))
    task = build_task(layered)
    stages = [s.train().to(dev, compute_dtype(precision))
              for s in layered.assemble().stages()]
    out = []
    for index in range(len(stages)):
        used = {b: _stage_bytes(stages, index, Sharder(task, b, 1), dev)
                for b in (sizes[0], *sizes)}  # the smaller size twice: warm-up, then measured
        lo, hi = used[sizes[0]], used[sizes[1]]
        slope = max((h - low) / (sizes[1] - sizes[0]) for low, h in zip(lo, hi))
        out.append((slope, max(max(lo) - sizes[0] * slope, 0.0)))
    del stages
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _stage_bytes(stages: list, index: int, sharder: Sharder, dev: torch.device) -> list[int]:
    """[bytes saved for backward, peak bytes allocated (CUDA; else 0)] of stage ``index``'s
    forward and backward on one micro-batch, its input made by the stages before it."""
    batch = sharder.batches(0, range(1))[0].to(dev)
    x = None
    with torch.no_grad():
        for before in stages[:index]:
            x = before(x, batch)
    if x is not None:
        x.requires_grad_(True)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        saved[st.data_ptr()] = st.nbytes()
        return t

    cuda = dev.type == "cuda"
    reset_peak(dev)
    start = torch.cuda.memory_allocated(dev) if cuda else 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stages[index](x, batch)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.ones_like(out))
    peak = torch.cuda.max_memory_allocated(dev) - start if cuda else 0
    stages[index].zero_grad(set_to_none=True)
    return [sum(saved.values()), peak]


def l2l_fit(run, mcfg: ModelConfig, precision: str, u: int, device: str, cap: int, *,
            warmup: int, tiny: bool) -> dict:
    """``run(micro_batch_size)`` -> a job's summary, at the estimated largest micro-batch. A
    job that runs out of device memory is tried again at half the micro-batch (four times at
    most); after such a fall, the midpoint back up is tried once (as the resident baseline's
    search refines its batch)."""
    mbs = 4 if tiny else l2l_micro_batch(mcfg, precision, u, device, cap)
    too_big = 0
    for attempt in range(5):
        try:
            s = run(mbs)
        except RuntimeError as e:
            if not out_of_memory(e) or mbs == 1 or attempt == 4:
                raise
            too_big, mbs = mbs, max(1, mbs // 2)
            print(f"micro-batch {too_big} x {u}: out of device memory; trying {mbs}",
                  flush=True)
            continue
        best = fit_result(s, mbs, u, warmup)
        if too_big - mbs > 1:
            mid = (mbs + too_big) // 2
            try:
                best = fit_result(run(mid), mid, u, warmup)
            except RuntimeError as e:
                if not out_of_memory(e):
                    raise
        return best
    raise AssertionError("unreachable")


def out_of_memory(e: Exception) -> bool:
    return "out of memory" in str(e).lower()


def fit_result(summary: dict, mbs: int, u: int, warmup: int) -> dict:
    seconds = steady_step_seconds(summary, warmup)
    return {"batch": mbs, "step_seconds": seconds, "samples_per_sec": u * mbs / seconds,
            "peak_bytes": peak_bytes(summary)}


def peak_bytes(summary: dict) -> int:
    return max(w["peak_memory_bytes"] for w in summary["workers"])


def depth_flat(peaks: dict[int, int]) -> float:
    """Deepest model's peak over the shallowest's."""
    depths = sorted(peaks)
    return peaks[depths[-1]] / peaks[depths[0]]


def transfer_ratios(device: torch.device, nbytes: int, reps: int = 10, rounds: int = 5) -> dict:
    """GB/s of H2D from, and D2H into, a registered shared-memory region (as the worker maps
    the EPS's) and a pin_memory() tensor of the same size: median of ``rounds`` interleaved
    rounds of ``reps`` copies each, timed with CUDA events."""
    from protocol.shm import Region
    from worker.streams import device_index, register_host, unregister_host

    torch.cuda.set_device(device_index(device))  # the timing events go on the current device
    region = Region.create(f"l2l-bench-transfer-{os.getpid()}", nbytes)
    shared, copies = region.base, {}
    try:
        if not register_host(shared, read_only=False):
            raise RuntimeError("cudaHostRegister refused the region (see the log)")
        try:
            pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            on_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
            copies = {("h2d", "registered"): lambda: on_dev.copy_(shared, non_blocking=True),
                      ("h2d", "pinned"): lambda: on_dev.copy_(pinned, non_blocking=True),
                      ("d2h", "registered"): lambda: shared.copy_(on_dev, non_blocking=True),
                      ("d2h", "pinned"): lambda: pinned.copy_(on_dev, non_blocking=True)}
            times: dict = defaultdict(list)
            for _ in range(rounds + 1):  # the first round warms up
                for key, copy in copies.items():
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                        enable_timing=True)
                    start.record()
                    for _ in range(reps):
                        copy()
                    end.record()
                    end.synchronize()
                    times[key].append(start.elapsed_time(end) / 1000 / reps)
            sync(device)
        finally:
            unregister_host(shared)
    finally:
        shared = copies = None  # no view of the mapping outlives it
        region.close()
        region.unlink()
    out: dict = {"mib": nbytes >> 20}
    for d in ("h2d", "d2h"):
        gbps = {k: nbytes / median(times[d, k][1:]) / 1e9 for k in ("registered", "pinned")}
        out[d] = {"registered_gbps": gbps["registered"], "pinned_gbps": gbps["pinned"],
                  "ratio": gbps["registered"] / gbps["pinned"]}
    return out


def trace_split(path: str, skip: int = 0) -> dict[str, float]:
    """Seconds per step of the worker's main thread by span category, each span counted
    without the spans nested in it (e.g. a wait inside a forward visit is "wait"), over the
    steps after the first ``skip`` (warm-up: the first step's compiles and cold caches made
    the split of a 2.09 s step add up to 3.9 s). A step begins with its "data" span."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e.get("ph") == "M"}
    workers = {pid for (pid, tid), n in names.items() if tid is None and
               n.startswith("l2l-worker")}
    spans = sorted((e for e in events if e.get("ph") == "X" and e["pid"] in workers and
                    names.get((e["pid"], e["tid"])) == "MainThread"),
                   key=lambda e: (e["ts"], -e["dur"]))
    starts: dict[int, list] = defaultdict(list)  # each worker's steps
    for e in spans:
        if e["name"] == "data":
            starts[e["pid"]].append(e["ts"])
    spans = [e for e in spans if skip <= 0 or len(starts[e["pid"]]) <= skip or
             e["ts"] >= starts[e["pid"]][skip]]
    own: dict[str, float] = defaultdict(float)
    stack: list[tuple[float, str]] = []  # (end, category) of the open spans
    for e in spans:
        while stack and stack[-1][0] <= e["ts"]:
            stack.pop()
        if stack:
            own[stack[-1][1]] -= e["dur"]
        own[e["cat"]] += e["dur"]
        stack.append((e["ts"] + e["dur"], e["cat"]))
    steps = max(1, sum(1 for e in spans if e["name"] == "data"))  # summed over workers
    return {cat: us / 1e6 / steps for cat, us in sorted(own.items())}
