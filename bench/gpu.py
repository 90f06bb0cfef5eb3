"""GPU benchmarks: ``python -m bench gpu [--only NAMES] [options]``. Every figure is a ratio
against a baseline measured in the same run, on the same GPU.

    transfer  H2D from a registered EPS shared-memory region and D2H into one, against a
              pin_memory() tensor of the same size (targets: >= 0.9x)
    engines   the EPS's update throughput on this host's cores (bench/engines.py; no GPU):
              what bounds a step when the GPU is fast
    overhead  exposed overhead of L2Lp: the EPS-backed worker against the same loop with
              every weight already on the device and AdamW run there
    paper     the paper's Tables 2/3 on one GPU: BERT-Large (24 x 1024, FFN 4096), device
              memory capped (default 16 GiB, a V100): the resident model at the largest batch
              that fits (fp32, AMP bf16) against L2L fp32 and CMP bf16 at u micro-batches, of
              the largest size that fits and of a small fixed size (32): where one micro-batch
              fills the GPU, u has nothing left to amortise
    depth     peak device memory of 24 .. 384 BERT-Large blocks (stash on the host)
    mfu       model FLOPs utilisation of the largest model the host RAM holds (bf16), and
              where the worker's time goes (its trace), beside the host's triad bandwidth
    llama     a Llama-3-shaped Hugging Face model (8B by default: random init on the GPU,
              save_pretrained in bf16, token ids as data) trained with bf16 optimizer moments:
              samples/s, MFU, the EPS's bytes per parameter, peak device memory
    peers     FSDP2 (fully_shard + CPUOffloadPolicy) and DeepSpeed ZeRO-3 with offload, same
              model, micro-batches and global batch as L2L: samples/s and peak device memory
    hfpeers   l2l at several activation budgets beside the resident model and the peers on a
              Hugging Face Llama of TinyLlama's shape (--hf-layers; 'beyond': deeper than the
              resident model can hold), or a mixture of experts of OLMoE-1B-7B's shape
              (--hf-arch olmoe): samples/s, MFU, peak device memory

``--tiny`` runs every piece with a tiny model on whatever device there is: it checks the
harness (the CPU suite does), its figures mean nothing.
"""

from __future__ import annotations

import argparse
import time

import torch

from eps_server.config import available_cores
from worker.config import ModelConfig

from .common import LiveRows, check, l2l_job, median, steady_step_seconds, table
from .gpu_parts import (
    depth_flat,
    fit_result,
    l2l_fit,
    peak_bytes,
    resident_fit,
    transfer_ratios,
)
from .local import local_l2l_step_seconds

PIECES = ("transfer", "engines", "overhead", "paper", "depth", "mfu", "llama", "peers",
          "hfpeers")
BERT_LARGE = dict(model="bert", layers=24, hidden=1024, heads=16, ffn=4096, vocab=30522,
                  classes=2)
TINY = dict(model="bert", layers=2, hidden=64, heads=4, ffn=256, vocab=128, classes=2)
GIB = 2**30
WORKER_THREADS = 4  # the L2L worker's torch threads (data, host-side copies)
# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) by device name, for MFU.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "B200": 2250.0}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", default=",".join(PIECES), help="comma-separated pieces")
    p.add_argument("--tiny", action="store_true",
                   help="a tiny model on --device (cpu works): checks the harness only")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--cap-gib", type=float, default=16.0, help="paper: device memory cap")
    p.add_argument("--seq", default="128,512", help="paper: sequence lengths")
    p.add_argument("--u", default="1,2,4,8", help="paper: micro-batches per visit")
    p.add_argument("--mbs", default="0,32",
                   help="paper: L2L micro-batch sizes, 0 for the largest that fits the cap (a "
                        "small fixed one shows what u buys where weight traffic dominates)")
    p.add_argument("--depths", default="24,48,96,384", help="depth: blocks")
    p.add_argument("--mfu-params", type=float, default=0.0,
                   help="mfu: billions of parameters; 0: the largest the host RAM holds")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="mfu: the GPU's dense bf16 peak; 0: from its name (H100/H200: 989)")
    p.add_argument("--llama-layers", type=int, default=32,
                   help="llama: decoder layers of the Llama-3 8B shape (32: 8.0B parameters)")
    p.add_argument("--llama-states", default="bf16", help="llama: --optimizer-states")
    p.add_argument("--llama-lora", type=int, default=0,
                   help="llama: LoRA rank (all-linear adapters, the base frozen); 0: every "
                   "parameter trains")
    p.add_argument("--hf-arch", default="llama", choices=("llama", "olmoe"),
                   help="hfpeers: the model's shape: TinyLlama's, or OLMoE-1B-7B's mixture of "
                        "experts (64 experts, 8 per token)")
    p.add_argument("--hf-layers", default="22",
                   help="hfpeers: layers of the model (TinyLlama's shape, 22: 1.1B parameters; "
                        "OLMoE's, 16: 6.9B); 'beyond' (llama): the fewest the resident model "
                        "cannot hold on this device")
    p.add_argument("--hf-us", default="4,8", help="hfpeers: l2l's micro-batches per visit "
                   "(the peers run at the first)")
    p.add_argument("--hf-budgets", default="0,-1",
                   help="hfpeers: l2l's --activation-budget-gib values (-1 auto; e.g. 39.5, "
                        "the resident model's peak)")
    p.add_argument("--peers", default="fsdp2,deepspeed")
    p.add_argument("--steps", type=int, default=3, help="measured steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--server-threads", type=int, default=0,
                   help="EPS math threads (the optimizer runs there); 0: l2l-launch's default, "
                        "the cores the worker's --threads 4 leave")
    p.add_argument("--transfer-mib", type=int, default=256)


def gpu(a) -> dict:
    cuda = torch.device(a.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"no CUDA device (torch {torch.__version__}); --tiny --device cpu "
                         "checks the harness on a CPU")
    if not cuda and not a.tiny:
        raise SystemExit("on a CPU only --tiny runs (the figures are GPU figures)")
    if cuda:  # events, streams and FSDP2's mesh in this process use the current device
        from worker.streams import device_index

        torch.cuda.set_device(device_index(torch.device(a.device)))
    names = [n for n in a.only.split(",") if n]
    unknown = [n for n in names if n not in PIECES]
    if unknown:
        raise SystemExit(f"unknown piece {unknown[0]!r}; pieces: {', '.join(PIECES)}")
    results, targets = {}, []
    for name in names:
        t0 = time.perf_counter()
        a.live = None
        try:
            r = piece(name)(a)
        except KeyboardInterrupt:  # the time budget ran out: keep the rows measured so far
            rows = a.live or []
            r = {"stopped": f"interrupted after {len(rows)} rows", "targets": [],
                 "rows": [[str(c) for c in row] for row in rows],
                 "table": table(f"{name}: STOPPED, the rows measured so far", a.live.headers,
                                rows) if rows else f"{name}: STOPPED before a row"}
        except Exception as e:  # one piece failing must not lose the others' figures
            r = {"error": f"{type(e).__name__}: {e}"[-4000:], "targets": [],
                 "table": f"{name}: FAILED: {type(e).__name__}: {str(e)[-1500:]}"}
        r["seconds"] = round(time.perf_counter() - t0, 1)
        results[name] = r
        targets += r["targets"]
        print(r["table"] + "\n", flush=True)  # as it comes: a piece can take minutes
        if "stopped" in r:
            break
    return {"table": "", "pieces": results, "targets": targets,
            "device": torch.cuda.get_device_name(a.device) if cuda else "cpu",
            "torch": torch.__version__}


def piece(name: str):
    """The function of piece ``name`` (mfu, llama and hfpeers live in gpu_models.py)."""
    from . import gpu_models

    return globals().get(f"bench_{name}") or getattr(gpu_models, f"bench_{name}")


def live(a, headers: list[str]) -> LiveRows:
    """The current piece's rows, printed as they come and kept if it is stopped."""
    a.live = LiveRows(headers)
    return a.live


def shape(a, **over) -> dict:
    return {**(TINY if a.tiny else BERT_LARGE), **over}


def model_argv(m: dict, *, seq: int, mbs: int, u: int) -> list[str]:
    argv = []
    for k in ("model", "layers", "hidden", "heads", "ffn", "vocab", "classes"):
        argv += [f"--{k}", str(m[k])]
    return argv + ["--seq-len", str(seq), "--micro-batch-size", str(mbs),
                   "--micro-batches", str(u), "--dropout", "0.1"]


def job(a, m: dict, *, seq: int, mbs: int, u: int, precision="fp32", extra=(), steps=None):
    """One L2L job (EPS + 1 worker on a.device): its summary. Activation budget 0 (the
    paper's constant-memory loop) unless ``extra`` gives one."""
    argv = model_argv(m, seq=seq, mbs=mbs, u=u) + ["--device", a.device, "--threads",
                                                    str(WORKER_THREADS)]
    return l2l_job(argv, steps=steps or a.warmup + a.steps,
                   extra=["--precision", precision, "--lr", "1e-4",
                          "--activation-budget-gib", "0", *extra],
                   server=["--server-threads", str(a.server_threads)])


def bench_transfer(a) -> dict:
    if torch.device(a.device).type != "cuda":
        return {"table": "transfer: needs CUDA (registration is a CUDA driver call)",
                "targets": [], "skipped": "no CUDA"}
    r = transfer_ratios(torch.device(a.device), (1 if a.tiny else a.transfer_mib) << 20)
    rows = [[d, r[d]["registered_gbps"], r[d]["pinned_gbps"], r[d]["ratio"]]
            for d in ("h2d", "d2h")]
    return {"table": table(f"transfer: {r['mib']} MiB, registered shm vs pin_memory()",
                           ["copy", "registered GB/s", "pinned GB/s", "ratio"], rows),
            **r, "targets": [check(f"{d} registered / pinned", r[d]["ratio"], ">=", 0.9)
                             for d in ("h2d", "d2h")]}


def bench_engines(a) -> dict:
    from .engines import MODES, engines

    return engines(argparse.Namespace(hidden=64 if a.tiny else 1024, layers=22,
                                      reps=1 if a.tiny else 3, threads="",
                                      modes=",".join(MODES)))


def bench_overhead(a) -> dict:
    m = shape(a, layers=4 if a.tiny else 12)
    seq, mbs, u = (32, 4, 4) if a.tiny else (128, 32, 4)
    mcfg = ModelConfig(**{k: v for k, v in m.items()}, seq_len=seq, dropout=0.1)
    local = local_l2l_step_seconds(mcfg, micro_batches=u, batch_size=mbs, steps=a.steps,
                                   warmup=a.warmup, device=a.device)
    s = job(a, m, seq=seq, mbs=mbs, u=u)
    l2lp = steady_step_seconds(s, a.warmup)
    waits = step_waits(s, a.warmup)
    rows = [["same loop, every weight on the device, AdamW there", local, 0.0, "-", "-", "-"],
            ["L2Lp: EPS on the host, prefetch + async pushes", l2lp, l2lp / local - 1,
             waits["fetch_wait"], waits["push_wait"],
             waits["eps_reduce_seconds"] + waits["eps_update_seconds"]]]
    return {"table": table(f"overhead: BERT L={m['layers']} H={m['hidden']} T={seq} u={u} "
                           f"B={mbs}, fp32", ["config", "s/step", "exposed overhead",
                                              "wait weights s", "wait slots+acks s",
                                              "EPS engine s"], rows),
            "step_seconds": {"local": local, "l2lp": l2lp}, "waits": waits,
            "targets": [check("L2Lp exposed overhead vs weights on device", l2lp / local - 1,
                              "<=", 0.10)]}


def step_waits(summary: dict, warmup: int) -> dict[str, float]:
    """Where a step's time goes: the worker's waits for weights (at a step's start, the EPS's
    last updates) and for gradient slots and pushes' acknowledgements (on CUDA also the device
    catching up with the kernels queued ahead), medians of the measured steps; and the EPS's
    engine seconds a step (reductions, with their finiteness checks, and updates; summed over
    its engines, averaged over every step)."""
    out = {k: median([w or 0.0 for w in summary[k][warmup:]] or [0.0])
           for k in ("fetch_wait", "push_wait")}
    eps = summary.get("eps", {})
    for k in ("reduce_seconds", "update_seconds"):
        out[f"eps_{k}"] = eps.get(k, 0.0) / max(1, eps.get("steps_completed", 1))
    return out


def bench_paper(a) -> dict:
    cap = 0 if a.tiny else int(a.cap_gib * GIB)
    headers = ["T", "config", "u", "batch", "samples/s", "peak GiB", "vs resident fp32"]
    rows, out, targets = live(a, headers), {}, []
    sizes = [min(int(n), 3) if a.tiny else int(n) for n in a.mbs.split(",")]  # tiny: small
    for seq in ([32] if a.tiny else [int(s) for s in a.seq.split(",")]):
        m = shape(a)
        mcfg = ModelConfig(**m, seq_len=seq, dropout=0.1)
        base = {}
        for p in ("fp32", "bf16"):
            r = base[p] = resident_fit(mcfg, p, a.device, cap, steps=a.steps, warmup=a.warmup,
                                       limit=2 if a.tiny else 1024)
            rows.append([seq, f"resident {p}{' (AMP)' if p == 'bf16' else ''}", "-",
                         r["batch"], r["samples_per_sec"], r["peak_bytes"] / GIB, 1.0])
        l2l, failed = {}, {}
        for mbs in sizes:  # 0: the largest micro-batch that fits; else fixed at mbs
            for p in ("bf16", "fp32"):  # CMP first: the claim against resident fp32 is its own
                for u in [int(x) for x in a.u.split(",")]:
                    label = ("L2L fp32" if p == "fp32" else "CMP bf16") + \
                        (" (B fixed)" if mbs else "")
                    run = lambda n, u=u, p=p: job(  # noqa: E731
                        a, m, seq=seq, mbs=n, u=u, precision=p,
                        extra=["--stash", "host", *(["--device-memory-gib", str(a.cap_gib)]
                                                    if cap else [])])
                    key = f"{p}_u{u}" + (f"_mbs{mbs}" if mbs else "")
                    try:
                        r = (fit_result(run(mbs), mbs, u, a.warmup) if mbs else
                             l2l_fit(run, mcfg, p, u, a.device, cap, warmup=a.warmup,
                                     tiny=a.tiny))
                    except RuntimeError as e:  # one configuration's failure costs its row only
                        failed[key] = str(e)[-3000:]
                        print(f"paper: T={seq} {label} u={u} FAILED: {str(e)[-3000:]}",
                              flush=True)
                        rows.append([seq, label, u, mbs or "-", "-", "-", "FAILED"])
                        continue
                    l2l[key] = r
                    rows.append([seq, label, u, r["batch"], r["samples_per_sec"],
                                 r["peak_bytes"] / GIB,
                                 r["samples_per_sec"] / base["fp32"]["samples_per_sec"]])
        cmp = [r["samples_per_sec"] for key, r in l2l.items() if key.startswith("bf16")]
        if cmp:
            targets.append(check(f"T={seq}: CMP / resident fp32 samples/s", max(cmp) /
                                 base["fp32"]["samples_per_sec"], ">=", 1.4))
        for mbs in sizes:
            end = f"_mbs{mbs}" if mbs else ""
            for p in ("fp32", "bf16"):
                one, four = l2l.get(f"{p}_u1{end}"), l2l.get(f"{p}_u4{end}")
                if one and four:
                    at = f"micro-batch {mbs}" if mbs else "largest micro-batch"
                    targets.append(check(f"T={seq}: {p} u=4 / u=1 samples/s ({at})",
                                         four["samples_per_sec"] / one["samples_per_sec"],
                                         ">=", 1.5))
        out[seq] = {"resident": base, "l2l": l2l, "failed": failed}
    cap_txt = f"{a.cap_gib:g} GiB cap" if cap else "no cap"
    failures = [f"T={seq} {k}" for seq, o in out.items() for k in o["failed"]]
    return {"table": table(f"paper: BERT-Large shape, {cap_txt}; batch = samples per "
                           "micro-batch (resident: per step; L2L: the largest that fits, or "
                           "fixed)", headers, rows),
            "by_seq": out, "targets": targets,
            **({"error": "failed: " + ", ".join(failures)} if failures else {})}


def bench_depth(a) -> dict:
    depths = [2, 4, 8] if a.tiny else [int(d) for d in a.depths.split(",")]
    seq, mbs = (32, 4) if a.tiny else (128, 8)
    headers = ["blocks", "block params (B)", "peak device MiB"]
    peaks, rows = {}, live(a, headers)
    for n in depths:
        s = job(a, shape(a, layers=n), seq=seq, mbs=mbs, u=2, precision="bf16",
                extra=["--stash", "host"], steps=2)
        peaks[n] = peak_bytes(s)
        rows.append([n, n * (12 * shape(a)["hidden"] ** 2) / 1e9, peaks[n] / 2**20])
    ratio = depth_flat(peaks)
    return {"table": table(f"depth: bf16, stash host, T={seq} u=2 B={mbs}", headers, rows),
            "peak_bytes": peaks, "targets": [check("deepest / shallowest peak device memory",
                                                   ratio, "<=", 1.05)]}


def bench_peers(a) -> dict:
    from .peers import PEERS, missing

    m = shape(a)
    seq, mbs, u = (32, 4, 2) if a.tiny else (128, 32, 4)
    mcfg = ModelConfig(**m, seq_len=seq, dropout=0.1)
    title = (f"peers: BERT L={m['layers']} H={m['hidden']} T={seq}, u={u} x B={mbs} per step, "
             f"{'bf16' if not a.tiny else 'fp32'}")
    # the last step's loss: the same model, data and AdamW give the same losses (to rounding
    # in fp32; close in bf16, whose casts differ by system)
    headers = ["system", "samples/s", "peak GiB", "l2l speed-up", "last loss"]
    names = [n for n in a.peers.split(",") if n]
    absent = {n: why for n in names if (why := missing(n))}
    if len(absent) == len(names):  # nothing to compare with: spare the L2L job
        return {"table": table(title, headers,
                               [[n, "-", "-", w, "-"] for n, w in absent.items()]),
                "systems": {n: {"error": w} for n, w in absent.items()}, "targets": [],
                "skipped": "; ".join(absent.values())}
    # The peers' optimizers run on the host in this process (FSDP2's AdamW, DeepSpeed's CPU
    # Adam through the same OpenMP runtime), as the EPS's do in its threads.
    torch.set_num_threads(a.server_threads or max(1, available_cores() - WORKER_THREADS))
    rows, out = live(a, headers), {}
    for p in ("fp32",) if a.tiny else ("bf16",):
        # budget 0 (every block but the last recomputed), then the default auto budget
        for key, budget in (("l2l_budget0", "0"), ("l2l", "-1")):
            s = job(a, m, seq=seq, mbs=mbs, u=u, precision=p,
                    extra=["--stash", "host", "--activation-budget-gib", budget])
            mine = {"samples_per_sec": u * mbs / steady_step_seconds(s, a.warmup),
                    "peak_bytes": peak_bytes(s), "losses": s["losses"],
                    "kept_blocks": s["workers"][0]["kept_blocks"]}
            out[key] = mine
            rows.append([f"l2l (EPS + 1 worker), activation budget {'auto' if key == 'l2l' else 0}"
                         f": {mine['kept_blocks']} blocks kept", mine["samples_per_sec"],
                         mine["peak_bytes"] / GIB, 1.0, s["losses"][-1]])
        rows[-2][3] = mine["samples_per_sec"] / out["l2l_budget0"]["samples_per_sec"]
        for name in names:
            try:
                r = PEERS[name](mcfg, micro_batches=u, batch_size=mbs, steps=a.steps,
                                warmup=a.warmup, device=a.device, precision=p)
            except Exception as e:  # not installed, or failed: say so beside the others
                r = {"error": f"{type(e).__name__}: {e}"[:500]}
            out[name] = r
            if "error" in r:
                rows.append([name, "-", "-", r["error"][:60], "-"])
            else:
                rows.append([name, r["samples_per_sec"], r["peak_bytes"] / GIB,
                             mine["samples_per_sec"] / r["samples_per_sec"], r["losses"][-1]])
    return {"table": table(title, headers, rows), "systems": out, "targets": []}


