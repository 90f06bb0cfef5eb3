"""What a job's inputs lack, found before any process starts (each worker would find it
seconds later, after its start-up): a model directory, data files, and what the model's own
names decide (--freeze's patterns, LoRA's targets, a --lora-init adapter)."""

from __future__ import annotations

import json
import os

from .config import DataConfig, ModelConfig


def missing_shards(path: str) -> list[str]:
    """The files ``path``'s model.safetensors.index.json names that are not there."""
    try:
        with open(os.path.join(path, "model.safetensors.index.json")) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []  # (no index, or one the loader says is damaged)
    return [s for s in shards if not os.path.isfile(os.path.join(path, s))]


def hf_dir_problem(path: str) -> str:
    """Why ``path`` is no local save_pretrained directory (nothing is downloaded), or ""."""
    if not os.path.isdir(path):
        return (f"--model hf:{path}: no such directory (a local save_pretrained directory: "
                "config.json, weights, tokenizer files)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        return f"--model hf:{path}: no config.json in it (a save_pretrained directory is expected)"
    if missing := missing_shards(path):
        return (f"--model hf:{path}: its model.safetensors.index.json lists "
                f"{', '.join(missing)}, not there (a copy or download not finished?)")
    return ""


def input_problems(model: ModelConfig, data: DataConfig) -> list[str]:
    """What is missing of the files a job reads, found before any process starts (each worker
    would find it seconds later, after its start-up)."""
    out = [hf_dir_problem(model.model[3:])] if model.model.startswith("hf:") else []
    for option, path in (("--data", data.data), ("--eval-data", data.eval_data)):
        if path and not os.path.isfile(path):
            out.append(f"{option} {path}: " + ("a folder; give one file" if os.path.isdir(path)
                                               else "no such file"))
    if (model.freeze or model.lora_rank) and not any(out):  # (patterns, targets, an adapter:
        # checked against the model's names)
        from .models import build_model

        try:
            build_model(model).manifest()
        except ValueError as e:
            out.append(str(e))
    return [p for p in out if p]
