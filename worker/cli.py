"""Command-line options of l2l-worker, shared by name with l2l-launch."""

from __future__ import annotations

import argparse

from .config import MODELS, STASHES, ModelConfig, WorkerConfig


def add_model_args(p: argparse.ArgumentParser) -> None:
    d = ModelConfig()
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=MODELS, default=d.model)
    g.add_argument("--layers", type=int, default=d.layers, help="number of transformer blocks")
    g.add_argument("--hidden", type=int, default=d.hidden)
    g.add_argument("--heads", type=int, default=d.heads)
    g.add_argument("--ffn", type=int, default=0, help="0: 4 x hidden")
    g.add_argument("--seq-len", type=int, default=d.seq_len)
    g.add_argument("--vocab", type=int, default=d.vocab)
    g.add_argument("--classes", type=int, default=d.classes)
    g.add_argument("--dropout", type=float, default=d.dropout)
    g.add_argument("--seed", type=int, default=d.seed)


def add_job_args(p: argparse.ArgumentParser) -> None:
    """Options of one worker that l2l-launch passes through unchanged."""
    d = WorkerConfig()
    g = p.add_argument_group("job")
    g.add_argument("--device", default=d.device, help="cpu, cuda or cuda:K")
    g.add_argument("--steps", type=int, default=d.steps, help="train until this many steps")
    g.add_argument("--micro-batches", type=int, default=d.micro_batches,
                   help="micro-batches per worker per step (u)")
    g.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size)
    g.add_argument("--transport", choices=("shm", "frames"), default=d.transport)
    g.add_argument("--grad-dtype", choices=("compute", "float32"), default=d.grad_dtype,
                   help="dtype of pushed gradients (sums are accumulated in fp32 either way)")
    g.add_argument("--stash", choices=STASHES, default=d.stash)
    g.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="wait for every fetch and push in turn (no L2Lp overlap)")
    g.add_argument("--copy-weights", action="store_true",
                   help="CPU: copy layers into worker memory instead of reading them in place")
    g.add_argument("--threads", type=int, default=d.threads, help="torch threads per worker")
    g.add_argument("--eps-timeout", type=float, default=d.eps_timeout)


def model_config(a: argparse.Namespace) -> ModelConfig:
    return ModelConfig(model=a.model, layers=a.layers, hidden=a.hidden, heads=a.heads,
                       ffn=a.ffn, seq_len=a.seq_len, vocab=a.vocab, classes=a.classes,
                       dropout=a.dropout, seed=a.seed)


def worker_config(a: argparse.Namespace, **over) -> WorkerConfig:
    fields = dict(endpoint=a.endpoint, rank=a.rank, world_size=a.world_size, device=a.device,
                  steps=a.steps, micro_batches=a.micro_batches,
                  micro_batch_size=a.micro_batch_size, transport=a.transport, stash=a.stash,
                  grad_dtype=a.grad_dtype,
                  threads=a.threads, eps_timeout=a.eps_timeout, save=a.save,
                  summary_json=a.summary_json, copy_weights=a.copy_weights, trace=a.trace,
                  overlap=a.overlap)
    fields.update(over)
    return WorkerConfig(**fields)


def job_argv(a: argparse.Namespace) -> list[str]:
    """The model and job options of ``a`` as l2l-worker arguments (used by l2l-launch)."""
    out = []
    for name in ("model", "layers", "hidden", "heads", "ffn", "seq_len", "vocab", "classes",
                 "dropout", "seed", "device", "steps", "micro_batches", "micro_batch_size",
                 "transport", "grad_dtype", "stash", "threads", "eps_timeout"):
        out += [f"--{name.replace('_', '-')}", str(getattr(a, name))]
    if a.copy_weights:
        out.append("--copy-weights")
    if not a.overlap:
        out.append("--no-overlap")
    return out


def parser() -> argparse.ArgumentParser:
    d = WorkerConfig()
    p = argparse.ArgumentParser(
        prog="l2l-worker", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="One L2L worker (one device): fetches layers from the EPS, runs all its "
                    "micro-batches through each, pushes each layer's gradient.")
    p.add_argument("--endpoint", default=d.endpoint, help="the eps-server's endpoint")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--save", default="", help="rank 0: write the trained model (safetensors)")
    p.add_argument("--summary-json", default="", help="write this worker's summary here")
    p.add_argument("--trace", default="", help="write a Chrome/Perfetto trace here")
    p.add_argument("--log-level", default="INFO")
    add_model_args(p)
    add_job_args(p)
    return p
