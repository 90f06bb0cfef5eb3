"""``--lora-init DIR``: a PEFT adapter's tensors as the initial values of the adapters and of
the modules trained whole (``adapter_model.safetensors``, PEFT's names:
``base_model.model.<the library's name>``, as ``--save`` writes them), the base model's from
the checkpoint. The options its config sets: worker/lora_options.py.

``check`` holds the file against the model's adapter before anything starts: every tensor
there, none left over (an adapter of another model, or of other targets), each of its shape.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from protocol.safetensors_io import SafetensorsFile
from protocol.tensors import LayerPlan, Manifest

from ...lora_options import read

ADAPTER_FILE = "adapter_model.safetensors"
TASKS = {"lm": "CAUSAL_LM", "classify": "SEQ_CLS"}  # PEFT's task_type of each objective


def _file(directory: str) -> SafetensorsFile:
    if not os.path.isdir(directory):
        raise ValueError(f"--lora-init {directory}: no such directory (a PEFT adapter's)")
    path = os.path.join(directory, ADAPTER_FILE)
    if not os.path.isfile(path):
        other = " (l2l reads safetensors only: adapter_model.bin is a pickle)" if (
            os.path.isfile(os.path.join(directory, "adapter_model.bin"))) else ""
        raise ValueError(f"--lora-init {directory}: no {ADAPTER_FILE}{other}")
    try:
        return SafetensorsFile(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"--lora-init {directory}: {e}") from None


def _wanted(model, manifest: Manifest) -> dict[str, tuple[int, ...]]:
    """The adapter file's names of what trains, with their shapes."""
    trains = model.lora_trains()
    return {model.adapter_name(la.name, t.name): t.shape for la in manifest.layers
            for t in la.tensors if t.tie is None and trains(la.name, t.name)}


def check(model, manifest: Manifest) -> None:
    """Refuse an adapter file that is not ``model``'s adapter (ValueError)."""
    directory = model.cfg.lora_init
    task, ours = read(directory).get("task_type"), TASKS[model.objective]
    if task in TASKS.values() and task != ours:
        raise ValueError(f"--lora-init {directory}: a {task} adapter, and this job trains a "
                         f"{ours} model (--classes, or a sequence classifier's checkpoint, "
                         "makes it SEQ_CLS)")
    file, want = _file(directory), _wanted(model, manifest)
    have = set(file.keys())
    missing, extra = sorted(set(want) - have), sorted(have - set(want))
    if missing:
        raise ValueError(f"--lora-init {directory}: the adapter has no {missing[0]} "
                         f"({len(missing)} of the {len(want)} tensors this model's adapter "
                         "trains are missing: an adapter of another model?)")
    if extra:
        raise ValueError(f"--lora-init {directory}: the adapter holds {extra[0]}, which this "
                         f"model's adapter has no place for ({len(extra)} such tensors: an "
                         "adapter of another model, or of modules l2l does not adapt?)")
    for name, shape in want.items():
        if file.shape(name) != tuple(shape):
            raise ValueError(f"--lora-init {directory}: {name} has shape {file.shape(name)}, "
                             f"the model's adapter needs {tuple(shape)}")


class AdapterInit:
    """A weight loader: the base model's tensors from ``base``, those that train (adapters,
    modules to save) from the adapter file, in its dtype (flat_of converts)."""

    def __init__(self, model, base):
        self.base, self.model = base, model
        self.file = _file(model.cfg.lora_init)
        self.trains = model.lora_trains()

    def load(self, plan: LayerPlan) -> dict[str, torch.Tensor]:
        mine = {s.name for s in plan.tensors if self.trains(plan.name, s.name)}
        out = self.base.load(replace(plan, tensors=tuple(
            s for s in plan.tensors if s.name not in mine)))
        for name in mine:  # (check has matched the names and shapes)
            out[name] = self.file.get(self.model.adapter_name(plan.name, name))
        return out
