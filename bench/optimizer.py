"""Per-layer update throughput of the EPS optimizers beside torch's, on the same tensors and
threads, and beside the machine's in-place streaming bandwidth measured in the same run.

One BERT-Large layer (12.6M fp32 parameters in 16 tensors, as its flat layer buffer).
Effective bandwidth counts the bytes an update must move: AdamW reads p, g, m, v and writes
p, m, v (28 B/param; +2 with a bf16 compute copy). The streaming reference is ``x.add_(y)``
(reads x, y, writes x: 12 B/element), the simplest in-place pass over memory.

"eps layer step" is all an EPS engine does for the layer in a step with one worker: check the
pushed bf16 gradient (finiteness and norm in one read), then AdamW reading it where it lies,
with the bf16 compute copy ("clip": the speculative update of a step with global-norm
clipping, which also keeps the gradient). Its time over "eps adamw + bf16 copy" is what the
work around the update costs: by bytes moved, the check adds 2 B to the update's 28 (1.07x),
keeping the gradient 2 more (1.14x); the targets leave each pass some overhead of its own
(1.25x, 1.35x). Here on one thread, in the caller's thread (the engines' pool: bench
engines).
"""

from __future__ import annotations

import argparse

import torch

from eps_server.buffers import BufferPool
from eps_server.config import OptimizerConfig
from eps_server.layer_math import LayerMath
from eps_server.optimizers import make_optimizer
from eps_server.pool import MathPool
from protocol.tensors import LayerSpec, Manifest, TensorSpec, plan_layout, views

from .common import check, interleaved, table


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)


def bert_layer(h: int):
    def lin(name, i, o):
        return [TensorSpec(name=f"{name}.weight", shape=(o, i)),
                TensorSpec(name=f"{name}.bias", shape=(o,), group="no_decay")]

    tensors = [*lin("attn.qkv", h, 3 * h), *lin("attn.proj", h, h),
               TensorSpec(name="norm1.weight", shape=(h,), group="no_decay"),
               TensorSpec(name="norm1.bias", shape=(h,), group="no_decay"),
               *lin("mlp.fc", h, 4 * h), *lin("mlp.proj", 4 * h, h),
               TensorSpec(name="norm2.weight", shape=(h,), group="no_decay"),
               TensorSpec(name="norm2.bias", shape=(h,), group="no_decay")]
    return plan_layout(Manifest(layers=(LayerSpec(name="l", kind="k",
                                                  tensors=tuple(tensors)),))).layers[0]


def optimizer(a) -> dict:
    torch.set_num_threads(a.threads)
    plan = bert_layer(a.hidden)
    n = plan.numel
    params = sum(s.numel for s in plan.tensors)
    master, grad = torch.randn(n), torch.randn(n) * 1e-3
    cfg = OptimizerConfig(name="adamw", lr=1e-4, weight_decay=0.01)
    t = {}

    x, y = torch.randn(n), torch.randn(n)
    eps_adamw = make_optimizer(plan, master, None, cfg)
    eps_bf16 = make_optimizer(plan, master.clone(), torch.empty(n, dtype=torch.bfloat16), cfg)
    lamb = make_optimizer(plan, master.clone(), None, OptimizerConfig(name="lamb", lr=1e-4))

    def layer_step(keep: bool):
        pool, buffers = MathPool(1, inline=True), BufferPool()
        math = LayerMath(plan, make_optimizer(plan, master.clone(), torch.empty(
            n, dtype=torch.bfloat16), cfg, pool=pool, buffers=buffers), pool, buffers)
        pushed = (grad.bfloat16(),)

        def step():
            math.check(pushed)
            math.release(math.update(pushed, 0, 1.0, cfg, keep=keep))
        return step

    def torch_adamw(**kw):
        ps = [v.clone().requires_grad_() for v in views(master, plan)]
        for p, g in zip(ps, views(grad, plan)):
            p.grad = g.clone()
        decay = [p for p, s in zip(ps, plan.tensors) if s.group == "decay"]
        no_decay = [p for p, s in zip(ps, plan.tensors) if s.group == "no_decay"]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                  {"params": no_decay, "weight_decay": 0.0}], lr=1e-4, **kw)

    fused, foreach = torch_adamw(fused=True), torch_adamw(foreach=True)
    contenders = {
        "stream": lambda: x.add_(y, alpha=1e-9),
        "eps adamw": lambda: eps_adamw.step((grad,), 0, lr=1e-4),
        "eps adamw + bf16 copy": lambda: eps_bf16.step((grad,), 0, lr=1e-4),
        "eps layer step": layer_step(False),
        "eps layer step, clip": layer_step(True),
        "eps lamb": lambda: lamb.step((grad,), 0, lr=1e-4),
        "torch adamw fused": fused.step,
        "torch adamw foreach": foreach.step,
    }
    try:  # optional: DeepSpeed's CPU Adam (JIT-builds a C++ extension on first use)
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore

        ps = [v.clone().requires_grad_() for v in views(master, plan)]
        for p, g in zip(ps, views(grad, plan)):
            p.grad = g.clone()
        contenders["deepspeed cpu adam"] = DeepSpeedCPUAdam(ps, lr=1e-4, adamw_mode=True).step
    except Exception:  # not installed or failed to build: skipped
        pass
    t = interleaved(contenders, a.reps)

    stream_gbs = 12 * n / t["stream"] / 1e9
    # a layer step reads the bf16 gradient (2 B) where the plain update reads fp32 (4 B), and
    # once more to check it; clipping also keeps it
    bytes_per = {"eps adamw + bf16 copy": 30, "eps layer step": 30,
                 "eps layer step, clip": 32}
    rows = [["x.add_(y) streaming", t["stream"], None, stream_gbs]]
    for name, secs in t.items():
        if name == "stream":
            continue
        per = bytes_per.get(name, 28)
        rows.append([name, secs, params / secs / 1e6, per * params / secs / 1e9])
    rows = [[r[0], r[1], "-" if r[2] is None else r[2], r[3]] for r in rows]
    eps_gbs = 28 * params / t["eps adamw"] / 1e9
    step_ratio = t["eps layer step"] / t["eps adamw + bf16 copy"]
    clip_ratio = t["eps layer step, clip"] / t["eps adamw + bf16 copy"]
    return {
        "table": table(f"optimizer: one BERT-Large layer, {params / 1e6:.1f}M params, "
                       f"{a.threads} thread(s)", ["update", "seconds", "Mparams/s", "GB/s"],
                       rows),
        "seconds": t,
        "ratios": {"eps_vs_torch_fused": t["torch adamw fused"] / t["eps adamw"],
                   "eps_vs_torch_foreach": t["torch adamw foreach"] / t["eps adamw"],
                   "eps_bandwidth_vs_streaming": eps_gbs / stream_gbs,
                   "lamb_over_adamw": t["eps lamb"] / t["eps adamw"],
                   "bf16_copy_overhead": t["eps adamw + bf16 copy"] / t["eps adamw"] - 1,
                   "layer_step_over_update": step_ratio,
                   "clipped_layer_step_over_update": clip_ratio},
        "targets": [
            check("EPS AdamW / torch fused AdamW speed", t["torch adamw fused"] / t["eps adamw"],
                  ">=", 0.95),
            check("EPS AdamW / torch foreach AdamW speed",
                  t["torch adamw foreach"] / t["eps adamw"], ">=", 5.0),
            check("EPS AdamW bandwidth / streaming bandwidth", eps_gbs / stream_gbs, ">=", 0.8),
            check("LAMB time / AdamW time", t["eps lamb"] / t["eps adamw"], "<=", 1.5),
            check("EPS layer step / its update", step_ratio, "<=", 1.25),
            check("EPS layer step with clipping / its update", clip_ratio, "<=", 1.35)],
    }
