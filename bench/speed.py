"""Speed of L2L against baselines, side by side in one run.

throughput  L2L (eps-server + 1 worker) vs the same model fully resident with gradient
            accumulation, and resident with per-layer activation checkpointing (the same
            recompute L2L does). Same samples per step, 1 compute thread each. ``--model
            olmoe``: a Hugging Face mixture of experts (OLMoE, 8 experts, 2 per token) of
            --layers x --hidden, built in a temporary directory, on random token ids.
overlap     exposed overhead = L2L step time / step time of the same L2L loop with all weights
            already local and the optimizer run in-process, minus 1; also without L2Lp overlap.
innerloop   L2L throughput for u = 1, 2, 4, 8 micro-batches per layer visit.

Note on threads: every configuration computes on one torch thread; in L2L the EPS runs the
optimizer in its own process (one more thread), as it would beside a GPU worker.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile

import torch

from worker.config import DataConfig, ModelConfig

from .common import check, free_port, l2l_job, median, steady_step_seconds, table
from .local import local_l2l_step_seconds, resident_step_seconds


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="bert",
                   help="bert, gpt; throughput also: olmoe (a Hugging Face mixture of experts "
                        "built here), or "
                        "hf:DIR with --data")
    p.add_argument("--data", default="", help="uint32 token ids for --model hf:DIR")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=6, help="measured steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu or cuda (the worker gets cuda:0)")
    p.add_argument("--rounds", type=int, default=3, help="recovery: jobs per configuration")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of every configuration's compute (worker or baseline)")


def model_cfg(a) -> ModelConfig:
    if a.model.startswith("hf:"):
        return ModelConfig(model=a.model, seq_len=a.seq_len)
    return ModelConfig(model=a.model, layers=a.layers, hidden=a.hidden, heads=a.heads,
                       seq_len=a.seq_len, vocab=1024, dropout=0.1)


def data_cfg(a) -> DataConfig | None:
    return DataConfig(data=a.data, token_dtype="uint32") if a.model.startswith("hf:") else None


def model_argv(a, micro_batches: int) -> list[str]:
    shape = (["--data", a.data, "--token-dtype", "uint32"] if a.model.startswith("hf:") else
             ["--layers", str(a.layers), "--hidden", str(a.hidden), "--heads", str(a.heads),
              "--vocab", "1024"])
    return ["--model", a.model, *shape, "--seq-len", str(a.seq_len),
            "--micro-batch-size", str(a.micro_batch_size), "--micro-batches",
            str(micro_batches), "--threads", str(a.threads), "--device", a.device]


@contextlib.contextmanager
def built_model(a):
    """--model olmoe: a Hugging Face OLMoE of --layers x --hidden (8 experts of --hidden, 2 per
    token, vocabulary 1024) and random token ids, in a temporary directory while the benchmark
    runs (``a.model`` is then its hf: path); the built-in models as they are."""
    if a.model != "olmoe":
        yield
        return
    from .hfdirs import hf_dir, token_file

    shape = dict(hidden_size=a.hidden, intermediate_size=a.hidden, num_attention_heads=a.heads,
                 num_key_value_heads=a.heads, num_experts=8, num_experts_per_tok=2,
                 vocab_size=1024, max_position_embeddings=max(512, a.seq_len),
                 tie_word_embeddings=False, pad_token_id=1, eos_token_id=2)
    with tempfile.TemporaryDirectory(prefix="l2l-olmoe-") as tmp:
        hf_dir(os.path.join(tmp, "model"), a.layers, shape, "cpu", "Olmoe", torch.float32)
        a.data = os.path.join(tmp, "tokens.bin")
        token_file(a.data, 1024, (a.warmup + a.steps + 1) * 8 * a.micro_batches *
                   a.micro_batch_size * (a.seq_len + 1))
        a.model, a.built = "hf:" + os.path.join(tmp, "model"), True
        try:
            yield
        finally:
            a.model, a.data, a.built = "olmoe", "", False


def l2l_seconds(a, micro_batches: int, extra=()) -> float:
    s = l2l_job(model_argv(a, micro_batches), steps=a.warmup + a.steps, extra=extra)
    return steady_step_seconds(s, a.warmup)


def throughput(a) -> dict:
    with built_model(a):
        return _throughput(a)


def _throughput(a) -> dict:
    torch.set_num_threads(a.threads)
    m, u, b = model_cfg(a), a.micro_batches, a.micro_batch_size
    if a.model.startswith("hf:"):  # its shape is its config's (the budgets' shares: layers)
        from worker.models import build_model

        c = build_model(m).config
        a.layers, a.hidden = c.num_hidden_layers, c.hidden_size
    samples = u * b
    plain = resident_step_seconds(m, micro_batches=u, batch_size=b, steps=a.steps,
                                  warmup=a.warmup, checkpoint=False,
                                  device=a.device, data=data_cfg(a))
    ckpt = resident_step_seconds(m, micro_batches=u, batch_size=b, steps=a.steps,
                                 warmup=a.warmup, checkpoint=True,
                                 device=a.device, data=data_cfg(a))
    l2l, budgets = budget_seconds(a, u)
    full = budgets[-1][2]
    rows = [["resident (plain)", plain, samples / plain, 1.0],
            ["resident + activation checkpointing", ckpt, samples / ckpt, plain / ckpt],
            *([f"L2L, activation budget {gib:.3g} GiB ({kept} of {a.layers} blocks kept)",
               t, samples / t, plain / t] for gib, kept, t in budgets)]
    return {
        "table": table(f"throughput: {name(a)} L={a.layers} H={a.hidden} T={a.seq_len} "
                       f"u={u} B={b}", ["config", "s/step", "samples/s", "vs plain"], rows),
        "step_seconds": {"resident": plain, "resident_checkpointed": ckpt, "l2l": l2l,
                         **{f"l2l_keep_{kept}": t for _, kept, t in budgets}},
        "ratios": {"l2l_vs_checkpointed": ckpt / l2l, "l2l_vs_resident": plain / l2l,
                   "l2l_all_kept_vs_resident": plain / full, "l2l_all_kept_vs_l2l": l2l / full},
        "targets": [check("L2L / checkpointed resident throughput", ckpt / l2l, ">=", 0.95),
                    check("L2L / plain resident throughput", plain / l2l, ">=", 0.72),
                    check("L2L keeping every block / plain resident", plain / full, ">=", 0.95),
                    check("L2L keeping every block / L2L budget 0", l2l / full, ">=", 1.2)],
    }


def name(a) -> str:
    return "OLMoE (8 experts, 2 per token)" if getattr(a, "built", False) else a.model


def budget_seconds(a, u: int) -> tuple[float, list[tuple[float, int, float]]]:
    """L2L's step time with activation budget 0 (only the last block keeps its graph), then
    budgets holding a quarter, half and all of the blocks, from the block's graph bytes the
    first run measured: [(GiB, blocks kept, seconds)]."""
    s = l2l_job(model_argv(a, u), steps=a.warmup + a.steps, extra=["--activation-budget-gib", "0"])
    zero = steady_step_seconds(s, a.warmup)
    per_block = s["workers"][0]["kept_block_bytes"]
    out = [(0.0, s["workers"][0]["kept_blocks"], zero)]
    for share in (4, 2, 1):
        more = -(-(a.layers - 1) // share)  # blocks beside the last one
        gib = (more * per_block + per_block // 2) / 2**30
        s = l2l_job(model_argv(a, u), steps=a.warmup + a.steps,
                    extra=["--activation-budget-gib", f"{gib:.6f}"])
        out.append((gib, s["workers"][0]["kept_blocks"], steady_step_seconds(s, a.warmup)))
    return zero, out


def overlap(a) -> dict:
    torch.set_num_threads(a.threads)
    m, u, b = model_cfg(a), a.micro_batches, a.micro_batch_size
    local = local_l2l_step_seconds(m, micro_batches=u, batch_size=b, steps=a.steps,
                                   warmup=a.warmup, device=a.device)
    l2lp = l2l_seconds(a, u)
    sync = l2l_seconds(a, u, extra=["--no-overlap"])
    rows = [["same loop, weights local, optimizer in-process", local, 0.0],
            ["L2Lp (EPS, prefetch + async push, eager update)", l2lp, l2lp / local - 1],
            ["L2L without overlap (every fetch and push waited)", sync, sync / local - 1]]
    return {
        "table": table(f"overlap: {a.model} L={a.layers} H={a.hidden} u={u} B={b}",
                       ["config", "s/step", "exposed overhead"], rows),
        "step_seconds": {"local": local, "l2lp": l2lp, "no_overlap": sync},
        "ratios": {"exposed_overhead": l2lp / local - 1,
                   "exposed_overhead_no_overlap": sync / local - 1},
        "targets": [check("exposed overhead (u >= 4)", l2lp / local - 1, "<=", 0.10)],
    }


def innerloop(a) -> dict:
    torch.set_num_threads(a.threads)
    m, b = model_cfg(a), a.micro_batch_size
    rows, out = [], {}
    for u in (1, 2, 4, 8):
        l2l = l2l_seconds(a, u)
        plain = resident_step_seconds(m, micro_batches=u, batch_size=b, steps=a.steps,
                                      warmup=a.warmup, checkpoint=False,
                                  device=a.device)
        out[u] = {"l2l_samples_per_sec": u * b / l2l, "resident_samples_per_sec": u * b / plain}
        rows.append([u, u * b / l2l, u * b / plain, plain / l2l])
    return {
        "table": table(f"innerloop: {a.model} L={a.layers} H={a.hidden} B={b}",
                       ["u", "L2L samples/s", "resident samples/s", "L2L / resident"], rows),
        "by_micro_batches": out,
        "ratios": {f"l2l_vs_resident_u{u}": v["l2l_samples_per_sec"] /
                   v["resident_samples_per_sec"] for u, v in out.items()},
        "targets": [],
    }


def alternate(a, configs: dict[str, list[str]]) -> tuple[dict, dict, int]:
    """Jobs of each server configuration in turn, a.rounds times: (median s/step, median EPS
    shared bytes, params) per configuration name."""
    u = a.micro_batches
    times: dict[str, list] = {k: [] for k in configs}
    shmem: dict[str, list] = {k: [] for k in configs}
    params = 0
    for _ in range(a.rounds):
        for name, server in configs.items():
            s = l2l_job(model_argv(a, u), steps=a.warmup + a.steps, server=server)
            times[name].append(steady_step_seconds(s, a.warmup))
            shmem[name].append(s["eps"]["rssshmem_bytes"])
            params = s["eps"]["params"]
    return ({k: median(v) for k, v in times.items()}, {k: median(v) for k, v in shmem.items()},
            params)


def recovery(a) -> dict:
    """The cost of exact recovery (--recovery, which l2l-launch --max-restarts turns on): the
    EPS copies each layer's served version aside before updating it."""
    t, mem, params = alternate(a, {"off": [], "on": ["--recovery"]})
    extra = (mem["on"] - mem["off"]) / params
    rows = [["without recovery", t["off"], 1.0, mem["off"] / 2**20],
            ["with --recovery", t["on"], t["on"] / t["off"], mem["on"] / 2**20]]
    return {
        "table": table(f"recovery: {a.model} L={a.layers} H={a.hidden} u={a.micro_batches} "
                       f"({params / 1e6:.1f}M params, fp32, {a.rounds} rounds)",
                       ["config", "s/step", "vs without", "EPS shared MiB"], rows),
        "step_seconds": {"without": t["off"], "with": t["on"]},
        "ratios": {"step_time_with_recovery": t["on"] / t["off"]},
        "extra_shared_bytes_per_param": extra,
        "targets": [check("step time with recovery / without", t["on"] / t["off"], "<=", 1.05),
                    check("extra EPS shared memory, bytes/param", extra, "<=", 4.5)],
    }


def metrics(a) -> dict:
    """What the EPS's Prometheus endpoint costs the training loop, scraped 5 times a second
    (it records nothing extra on the request path; the collector reads counters when
    scraped). The launcher's console and the workers' wait clocks are on in both."""
    import threading
    import urllib.request

    port, stop, scrapes = free_port(), threading.Event(), [0]

    def scraper() -> None:  # as Prometheus would, but 5 times a second
        while not stop.wait(0.2):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
                scrapes[0] += 1
            except OSError:
                pass  # an "off" job, or between jobs

    thread = threading.Thread(target=scraper, daemon=True)
    thread.start()
    try:
        t, _, params = alternate(a, {"off": [], "on": ["--metrics-port", str(port)]})
    finally:
        stop.set()
        thread.join()
    rows = [["metrics off", t["off"], 1.0], ["--metrics-port", t["on"], t["on"] / t["off"]]]
    return {
        "table": table(f"metrics: {a.model} L={a.layers} H={a.hidden} u={a.micro_batches} "
                       f"({a.rounds} rounds, interleaved; {scrapes[0]} scrapes)",
                       ["config", "s/step", "vs off"], rows),
        "step_seconds": {"off": t["off"], "on": t["on"]},
        "ratios": {"step_time_with_metrics": t["on"] / t["off"]},
        "targets": [check("step time with metrics / without", t["on"] / t["off"], "<=", 1.03)],
    }
