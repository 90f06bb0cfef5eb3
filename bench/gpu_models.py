"""The GPU benchmarks' model pieces (bench/gpu.py runs them): MFU of a wide GPT as large as
the host holds, a Llama-3-shaped Hugging Face model trained with bf16 optimizer moments, and
the peers on a Hugging Face Llama of TinyLlama's shape (hfpeers).
"""

from __future__ import annotations

import gc
import math
import os
import tempfile
import time

import torch

from eps_server.config import available_cores

from .common import check, l2l_job, steady_step_seconds, table
from .gpu import GIB, PEAK_BF16_TFLOPS, WORKER_THREADS, job, step_waits
from .gpu_parts import MEM, SHM, peak_bytes, trace_split
from .hfdirs import LLAMA_8B, LLAMA_TINY, SHAPES, TINYLLAMA, active_params, hf_dir, token_file


def mfu_shape(a) -> dict:
    """A wide GPT (H=4096, 32 heads) as deep as --mfu-params, or as the host holds: the EPS
    keeps MEM bytes per parameter (fp32 master, AdamW m and v, the bf16 copy), SHM of them in
    shared memory, whose file system may be smaller than the RAM."""
    if a.tiny:
        return dict(model="gpt", layers=2, hidden=64, heads=4, ffn=256, vocab=128, classes=2)
    hidden = 4096
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    shm = os.statvfs("/dev/shm")
    params = a.mfu_params * 1e9 or min(0.6 * ram / MEM, 0.8 * shm.f_bavail * shm.f_frsize / SHM)
    layers = max(1, int(params // (12 * hidden**2)))
    return dict(model="gpt", layers=layers, hidden=hidden, heads=32, ffn=4 * hidden,
                vocab=32000, classes=2)


def bench_mfu(a) -> dict:
    m = mfu_shape(a)
    seq, mbs, u = (32, 2, 2) if a.tiny else (1024, 8, 8)
    with tempfile.TemporaryDirectory(prefix="l2l-mfu-") as tmp:
        trace = os.path.join(tmp, "trace.json")
        s = job(a, m, seq=seq, mbs=mbs, u=u, precision="bf16",
                extra=["--stash", "host", "--trace", trace, "--activation-budget-gib", "-1"],
                steps=a.warmup + a.steps)
        split = trace_split(trace, skip=a.warmup)
    params = s["eps"]["params"]
    step = steady_step_seconds(s, a.warmup)
    flops = 6 * params * mbs * u * seq / step
    mfu, peak = model_flops_utilisation(a, flops)
    rows = [[k, v, v / max(sum(split.values()), 1e-9)] for k, v in split.items()]
    waits = step_waits(s, a.warmup)
    # The EPS's work a step is bound by the host's memory: one worker's bf16 gradient read to
    # check it (2 B) and by AdamW with its bf16 copy (28 B), against the triad measured now.
    from .engines import triad_gb_per_s

    triad = triad_gb_per_s(available_cores(), numel=1 << 22 if a.tiny else 1 << 28)
    eps_seconds = waits["eps_reduce_seconds"] + waits["eps_update_seconds"]
    bound = 30 * params / (0.7 * triad * 1e9)
    rows += [["summary: median wait for weights", waits["fetch_wait"], "-"],
             ["summary: median wait for slots+acks", waits["push_wait"], "-"],
             ["EPS engines: checking (seconds/step)", waits["eps_reduce_seconds"], "-"],
             ["EPS engines: updating (seconds/step)", waits["eps_update_seconds"], "-"],
             [f"EPS at 0.7 of the host's triad ({triad:.0f} GB/s), 30 B/param", bound, "-"],
             [f"blocks kept by the auto activation budget (of {m['layers']})",
              s["workers"][0]["kept_blocks"], "-"],
             ["peak device GiB", peak_bytes(s) / GIB, "-"]]
    return {"table": table(f"mfu: GPT L={m['layers']} H={m['hidden']} "
                           f"({params / 1e9:.2f}B params) bf16 T={seq} u={u} B={mbs}: "
                           f"{step:.2f} s/step, {flops / 1e12:.0f} TFLOP/s, MFU {mfu:.1%} of "
                           f"{peak:g}; worker main thread by category (host seconds/step)",
                           ["category", "s/step", "share"], rows),
            "params": params, "step_seconds": step, "tflops": flops / 1e12, "mfu": mfu,
            "time_split": split, "waits": waits, "triad_gb_per_s": triad,
            "kept_blocks": s["workers"][0]["kept_blocks"], "peak_bytes": peak_bytes(s),
            "eps_seconds_per_step": eps_seconds, "eps_bound_seconds": bound,
            "targets": [] if a.tiny else [
                check("MFU", mfu, ">=", 0.55),
                check("EPS seconds a step / 30 B/param at 0.7 of the triad", eps_seconds / bound,
                      "<=", 1.0)]}


def model_flops_utilisation(a, flops: float) -> tuple[float, float]:
    """(MFU, the dense bf16 peak it is of: --peak-tflops or from the device's name)."""
    name = torch.cuda.get_device_name(a.device) if torch.device(a.device).type == "cuda" else ""
    peak = a.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), 0.0)
    return (flops / (peak * 1e12) if peak else float("nan")), peak


def bench_llama(a) -> dict:
    seq, mbs, u = (32, 2, 2) if a.tiny else (1024, 8, 4)
    layers = 2 if a.tiny else a.llama_layers
    with tempfile.TemporaryDirectory(prefix="l2l-llama-") as tmp:
        t0 = time.perf_counter()
        shape = LLAMA_TINY if a.tiny else LLAMA_8B
        params = hf_dir(os.path.join(tmp, "model"), layers, shape, a.device)
        made = time.perf_counter() - t0
        vocab = shape["vocab_size"]
        data = os.path.join(tmp, "tokens.bin")
        steps = a.warmup + a.steps
        token_file(data, vocab, (steps + 1) * u * mbs * (seq + 1))
        argv = ["--model", f"hf:{os.path.join(tmp, 'model')}", "--data", data,
                "--token-dtype", "uint32", "--seq-len", str(seq), "--micro-batch-size",
                str(mbs), "--micro-batches", str(u), "--device", a.device, "--threads",
                str(WORKER_THREADS)]
        lora = (["--lora-rank", str(a.llama_lora), "--lora-alpha", str(2 * a.llama_lora),
                 "--lora-targets", "all-linear"] if a.llama_lora else [])
        s = l2l_job(argv, steps=steps, extra=["--precision", "bf16", "--lr", "1e-5",
                                              "--optimizer-states", a.llama_states,
                                              "--stash", "device", *lora],
                    server=["--server-threads", str(a.server_threads)])
    step = steady_step_seconds(s, a.warmup)
    flops = (4 if a.llama_lora else 6) * params * mbs * u * seq / step  # LoRA: no weight
    # gradients for the frozen base (forward 2P, input gradients 2P per token)
    mfu, peak = model_flops_utilisation(a, flops)
    eps = s["eps"]
    rows = [["parameters (B)", params / 1e9], ["model built and saved (s)", made],
            ["job wall time (s)", s.get("elapsed_seconds", 0.0)], ["s/step", step],
            ["samples/s", u * mbs / step], ["TFLOP/s", flops / 1e12], ["MFU", mfu],
            ["EPS bytes/param held", eps.get("bytes_per_param", 0.0)],
            ["EPS peak RSS growth, bytes/param", eps.get("rss_growth_per_param", 0.0)],
            ["peak device GiB", peak_bytes(s) / GIB]]
    what = f"LoRA r={a.llama_lora} all-linear" if a.llama_lora else "optimizer states " + \
        a.llama_states
    return {"table": table(f"llama: Llama-3 shape, {layers} layers, bf16, {what}, T={seq} "
                           f"u={u} B={mbs}, stash on the device",
                           ["", "value"], rows),
            "params": params, "step_seconds": step, "mfu": mfu, "peak_tflops": peak,
            "eps": {k: eps.get(k) for k in ("bytes_per_param", "rss_growth_per_param",
                                            "vmhwm_bytes", "update_seconds",
                                            "reduce_seconds", "steps_completed")},
            "peak_bytes": peak_bytes(s), "losses": s["losses"], "targets": []}


def bench_hfpeers(a) -> dict:
    """l2l at each --hf-budgets (default 0 and auto) and --hf-us (default 4 and 8) beside the
    peers of --peers (bench/peers.py) at the first u, on a Hugging Face model of --hf-arch's
    shape (llama: TinyLlama's, --hf-layers 22: 1.1B parameters; olmoe: OLMoE-1B-7B's mixture
    of experts, 16 layers: 6.9B), T=1024, micro-batch 8, bf16: samples/s and peak device
    memory; MFU at 6 FLOPs per active parameter (a mixture's chosen experts) and token."""
    from worker.config import DataConfig, ModelConfig

    from .gpu import live
    from .peers import PEERS, missing

    seq, mbs = (32, 2) if a.tiny else (1024, 8)
    us = (2,) if a.tiny else tuple(int(u) for u in a.hf_us.split(","))
    budgets = [b.strip() for b in a.hf_budgets.split(",") if b.strip()]
    arch, full, tiny = SHAPES[a.hf_arch]
    shape = tiny if a.tiny else full
    layers = 2 if a.tiny else hf_depth(a.hf_layers, a.device, a.hf_arch)
    precision = "fp32" if a.tiny else "bf16"
    # ratio: an l2l row's speed over l2l at the first budget; a peer's, l2l's best over its
    headers = ["system", "u", "samples/s", "MFU", "peak GiB", "ratio", "last loss"]
    rows, out = live(a, headers), {}
    with tempfile.TemporaryDirectory(prefix="l2l-hfpeers-") as tmp:
        model = os.path.join(tmp, "model")
        params = hf_dir(model, layers, shape, a.device, arch)
        active = active_params(shape, layers, params)
        # 6 FLOPs per active parameter and token (attention's own left out), of the bf16 peak
        mfu = lambda r: model_flops_utilisation(  # noqa: E731
            a, 6 * active * seq * r["samples_per_sec"])[0]
        vocab = shape["vocab_size"]
        data = os.path.join(tmp, "tokens.bin")
        steps = a.warmup + a.steps
        token_file(data, vocab, (steps + 1) * max(us) * mbs * (seq + 1))
        for u in us:
            argv = ["--model", f"hf:{model}", "--data", data, "--token-dtype", "uint32",
                    "--seq-len", str(seq), "--micro-batch-size", str(mbs), "--micro-batches",
                    str(u), "--device", a.device, "--threads", str(WORKER_THREADS)]
            for budget in budgets:
                s = l2l_job(argv, steps=steps, extra=["--precision", precision, "--lr", "1e-4",
                                                      "--stash", "host",
                                                      "--activation-budget-gib", budget],
                            server=["--server-threads", str(a.server_threads)])
                r = out[l2l_key(u, budget)] = {
                    "samples_per_sec": u * mbs / steady_step_seconds(s, a.warmup),
                    "peak_bytes": peak_bytes(s), "losses": s["losses"],
                    "kept_blocks": s["workers"][0]["kept_blocks"]}
                first = out[l2l_key(u, budgets[0])]
                rows.append([f"l2l, budget {'auto' if budget == '-1' else budget}: "
                             f"{r['kept_blocks']} of {layers} blocks kept", u,
                             r["samples_per_sec"], mfu(r), r["peak_bytes"] / GIB,
                             r["samples_per_sec"] / first["samples_per_sec"], r["losses"][-1]])
        mcfg = ModelConfig(model=f"hf:{model}", seq_len=seq, dropout=0.0)
        dcfg = DataConfig(data=data, token_dtype="uint32")
        torch.set_num_threads(a.server_threads or max(1, available_cores() - WORKER_THREADS))
        mine = max(out[l2l_key(us[0], b)]["samples_per_sec"] for b in budgets)
        for name in [n for n in a.peers.split(",") if n]:
            gc.collect()  # the previous system's memory back, cached blocks included
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            try:
                if why := missing(name):
                    raise RuntimeError(why)
                r = PEERS[name](mcfg, micro_batches=us[0], batch_size=mbs, steps=a.steps,
                                warmup=a.warmup, device=a.device, precision=precision,
                                data=dcfg)
            except Exception as e:  # out of memory, not installed: said beside the others
                r = {"error": f"{type(e).__name__}: {e}"[:500]}
            out[name] = r
            rows.append([name, us[0], *(["-", "-", "-", r["error"][:60], "-"] if "error" in r
                                        else [r["samples_per_sec"], mfu(r),
                                              r["peak_bytes"] / GIB, mine / r["samples_per_sec"],
                                              r["losses"][-1]])])
    fsdp = out.get("fsdp2", {}).get("samples_per_sec")
    auto = [(u, out[l2l_key(u, "-1")]["samples_per_sec"] / out[l2l_key(u, "0")]["samples_per_sec"])
            for u in us if {"0", "-1"} <= set(budgets)]
    what = ("Llama, TinyLlama's shape" if a.hf_arch == "llama" else
            "OLMoE, OLMoE-1B-7B's shape")
    return {"table": table(f"hfpeers: Hugging Face {what}, {layers} layers ({params / 1e9:.2f}B"
                           f", {active / 1e9:.2f}B active), {precision}, T={seq} B={mbs}",
                           headers, rows),
            "params": params, "active_params": active, "systems": out,
            "targets": [] if a.tiny else [
                *(check(f"l2l auto / budget 0 at u={u}", ratio, ">=", 1.15) for u, ratio in auto),
                *([check(f"l2l (best budget, u={us[0]}) / FSDP2 CPUOffload (fused)",
                         mine / fsdp, ">=", 2.0)] if fsdp else [])]}


# The resident model's device memory on the TinyLlama shape at T=1024, micro-batch 8, bf16
# autocast (fp32 master, gradients and fused AdamW state, one micro-batch's activations),
# fitted to its 39.5 GiB at 22 layers (H100 and H200 alike): embeddings, head and logits, and
# each decoder layer. The host: FSDP2 and DeepSpeed offload keep about 20 bytes a parameter.
RESIDENT_BASE, RESIDENT_PER_LAYER, OFFLOAD_BYTES = 4.3 * GIB, 1.6 * GIB, 20


def hf_depth(layers: str, device: str, arch: str = "llama") -> int:
    """--hf-layers: a number, or 'beyond' (llama): the fewest TinyLlama-shaped layers whose
    resident training needs 15% more than the device holds (its out-of-memory row is the
    point), while the offloading peers' host memory still fits in 80% of this host's RAM."""
    if layers != "beyond":
        return int(layers)
    if arch != "llama":
        raise SystemExit("--hf-layers beyond is sized for --hf-arch llama; give a number")
    dev = torch.device(device)
    if dev.type != "cuda":
        raise SystemExit("--hf-layers beyond needs a CUDA device (it is sized by its memory)")
    total = torch.cuda.get_device_properties(dev).total_memory
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return layers_beyond(total, ram)


def layers_beyond(device_bytes: int, host_bytes: int) -> int:
    want = math.ceil((1.15 * device_bytes - RESIDENT_BASE) / RESIDENT_PER_LAYER)
    h, i, kv = (TINYLLAMA[k] for k in ("hidden_size", "intermediate_size",
                                       "num_key_value_heads"))
    per_layer = 2 * h * h + 2 * h * (h // TINYLLAMA["num_attention_heads"]) * kv + 3 * h * i
    fits = int((0.8 * host_bytes / OFFLOAD_BYTES - 2 * TINYLLAMA["vocab_size"] * h) // per_layer)
    if fits < want:
        raise SystemExit(f"--hf-layers beyond: {want} layers outgrow the device, but the "
                         f"offloading peers' host memory holds {fits}")
    return want


def l2l_key(u: int, budget: str) -> str:
    return f"l2l_u{u}_" + {"-1": "auto", "0": "budget0"}.get(budget, f"budget{budget}")
