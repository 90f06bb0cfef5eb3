"""l2l-export: an EPS checkpoint in the model's own format, without a running job: a Hugging
Face directory (``from_pretrained`` loads it) for an ``hf:`` model, else the assembled model's
safetensors.

    l2l-export CKPT OUT [--config runs/<run id>/config.json] [--model ...]

The model options come from the checkpoint (an EPS started by l2l-launch records them), then
--config (a job file: l2l-launch's runs/<run id>/config.json; its other sections are ignored),
then the flags; they must describe the checkpoint's model (its manifest must hash the same).
An hf: model's source directory gives the config and the tokenizer files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field

from protocol import checkpoints, cli
from protocol.checkpoint_tensors import CheckpointTensors
from protocol.tensors import manifest_difference, manifest_from_json, plan_layout

from .config import ModelConfig, check_save
from .models import build_model


@dataclass(kw_only=True)
class ExportConfig:
    """What to export and where."""

    checkpoint: str = ""
    """An EPS checkpoint directory (--server-save, l2l-ctl save)."""
    out: str = ""
    """Where to write: a directory for an hf: model, else a .safetensors file."""


@dataclass(kw_only=True)
class ExportArgs:
    export: ExportConfig = field(default_factory=ExportConfig)
    model: ModelConfig = field(default_factory=ModelConfig)


def export_checkpoint(checkpoint: str, out: str, mcfg: ModelConfig) -> int:
    """Write the checkpoint's weights with ``mcfg``'s model; returns the checkpoint's step.
    ``checkpoint``: a root (its latest) or one checkpoint directory, checked against its
    checksums."""
    check_save(mcfg, out, "--out")
    checkpoint = checkpoints.resolve(checkpoint)
    checkpoints.verify(checkpoint)
    with open(os.path.join(checkpoint, "manifest.json")) as f:
        saved = manifest_from_json(json.load(f))
    with open(os.path.join(checkpoint, "state.json")) as f:
        state = json.load(f)
    step = int(state["step"])
    # (what --lora-init set is in the options; its adapter is not needed to write the result)
    model = build_model(dataclasses.replace(mcfg, lora_init="") if mcfg.lora_rank else mcfg)
    manifest = model.manifest()
    if manifest.hash() != saved.hash():
        why = manifest_difference(saved, manifest) or "manifests differ"
        if "model" not in state:  # written by an eps-server that was not given them
            why += ("; the checkpoint does not record its model options: give them, or "
                    f"--config runs/{state.get('run_id', '<run id>')}/config.json (its job's)")
        raise ValueError(f"the model options do not describe the checkpoint's model: {why}")
    tensors = {}
    reader = CheckpointTensors(checkpoint, state)  # one EPS's files, or a shard job's boxes'
    for plan in plan_layout(manifest).layers:
        names = model.exported(plan)  # (a LoRA adapter: its own tensors only)
        if names:  # (views of the layer, but copies where an export may replace a frozen
            values = reader.master_tensors(plan)  # tensor: the layer is let go then)
            copy = bool(plan.frozen_names.intersection(names))
            tensors.update({(plan.name, n): values[n].clone() if copy else values[n]
                            for n in names})
    model.export(out, tensors, {"format": "pt", "steps": str(step)})
    return step


def recorded(given: dict) -> dict:
    """The model options the checkpoint records, under those ``given`` (--config, flags)."""
    try:
        path = checkpoints.resolve(given["export"]["checkpoint"])
        with open(os.path.join(path, "state.json")) as f:
            model = json.load(f).get("model")
    except (KeyError, TypeError, OSError, ValueError, AttributeError):
        return {}  # no checkpoint given, or one export_checkpoint says is unreadable
    if not isinstance(model, dict):
        return {}
    # (the LoRA options --lora-init set are recorded; its directory is not needed again)
    return {"model": {k: v for k, v in model.items() if k != "lora_init"}}


def main(argv: list[str] | None = None) -> int:
    by_flag = {o.flag: o for o in cli.options(ExportArgs)}
    args = cli.parse(ExportArgs, argv, "l2l-export",
                     " ".join(__doc__.split("\n\n")[0].split()), other_sections=True,
                     under=recorded, positionals=(by_flag["--checkpoint"], by_flag["--out"]))
    if not args.export.checkpoint or not args.export.out:
        print("l2l-export: give the checkpoint and where to write (CKPT OUT, or --checkpoint and "
              "--out)", file=sys.stderr)
        return 2
    try:
        step = export_checkpoint(args.export.checkpoint, args.export.out, args.model)
    except (OSError, ValueError, KeyError) as e:
        print(f"l2l-export: {e}", file=sys.stderr)
        return 1
    print(f"exported step {step} of {args.export.checkpoint} to {args.export.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
