"""Atomic checkpoints of the EPS: manifest, fp32 master, optimizer state, step.

A checkpoint is a directory:
  manifest.json          the model manifest (the EPS can start from it alone)
  state.json             format, step, manifest hash, optimizer config
  master.safetensors     "<layer>/<tensor>" -> fp32 tensor with its real shape
  optimizer.safetensors  "<layer>/<group index>.<state key>" -> optimizer state

It is written to ``<path>.tmp-<pid>`` (files fsynced) and renamed into place; a previous
checkpoint at ``path`` is moved aside first and removed after the rename, and ``load`` falls
back to it if a crash happened in between. A ``path`` that holds anything but a checkpoint is
refused, never replaced.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from dataclasses import dataclass

import torch
from safetensors import safe_open

from protocol.safetensors_io import write_safetensors
from protocol.tensors import Manifest, manifest_from_json, manifest_to_json, plan_layout, views

FORMAT = 1


def check_target(path: str) -> None:
    """Raise ValueError unless ``path`` may receive a checkpoint: it does not exist, is an
    empty directory, or holds a checkpoint (which is replaced). Anything else is left alone."""
    path = os.path.abspath(path)
    if not os.path.exists(path):
        if not os.path.isdir(os.path.dirname(path)):
            raise ValueError(f"cannot write a checkpoint to {path}: no such parent directory")
        return
    if not os.path.isdir(path):
        raise ValueError(f"{path} exists and is not a directory; not overwriting it")
    if os.listdir(path) and not os.path.isfile(os.path.join(path, "state.json")):
        raise ValueError(f"{path} is a non-empty directory that is not a checkpoint; "
                         "not replacing it")


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def save(path: str, store, optimizers, extra: dict) -> None:
    """Write the store's master and the optimizers' state at a step boundary (math thread)."""
    check_target(path)
    path = os.path.abspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp, mode=0o700)
    try:
        _write_json(os.path.join(tmp, "manifest.json"), manifest_to_json(store.manifest))
        _write_json(os.path.join(tmp, "state.json"),
                    {"format": FORMAT, "step": store.step, "versions": store.versions,
                     "manifest_hash": store.manifest_hash, **extra})
        master, opt_state = [], []
        for plan in store.layout.layers:
            for slot, view in zip(plan.tensors, views(store.master(plan.index), plan)):
                master.append((f"{plan.name}/{slot.name}", view))
            for key, t in optimizers[plan.index].state_tensors().items():
                opt_state.append((f"{plan.name}/{key}", t))
        write_safetensors(os.path.join(tmp, "master.safetensors"), master)
        write_safetensors(os.path.join(tmp, "optimizer.safetensors"), opt_state)
        _fsync_dir(tmp)
        old = f"{path}.old-{os.getpid()}"
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(os.path.dirname(path))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Loaded:
    path: str
    manifest: Manifest
    state: dict


def resolve(path: str) -> str:
    """The checkpoint directory to read: ``path`` or, after a crash mid-rename, its .old twin."""
    if os.path.isfile(os.path.join(path, "state.json")):
        return path
    olds = sorted(glob.glob(f"{glob.escape(path)}.old-*"))
    for old in olds:
        if os.path.isfile(os.path.join(old, "state.json")):
            return old
    raise FileNotFoundError(f"no checkpoint at {path}")


def read_meta(path: str) -> Loaded:
    path = resolve(path)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = manifest_from_json(json.load(f))
    with open(os.path.join(path, "state.json")) as f:
        state = json.load(f)
    if state.get("format") != FORMAT:
        raise ValueError(f"{path}: unsupported checkpoint format {state.get('format')}")
    if state["manifest_hash"] != manifest.hash():
        raise ValueError(f"{path}: manifest does not match its recorded hash")
    return Loaded(path, manifest, state)


def load_into(loaded: Loaded, store, optimizers) -> None:
    """Fill the store's master and the optimizers' state from a checkpoint."""
    layout = plan_layout(loaded.manifest)
    with safe_open(os.path.join(loaded.path, "master.safetensors"), framework="pt") as f:
        for plan in layout.layers:
            for slot, view in zip(plan.tensors, views(store.master(plan.index), plan)):
                t = f.get_tensor(f"{plan.name}/{slot.name}")
                if tuple(t.shape) != slot.shape:
                    raise ValueError(f"checkpoint tensor {plan.name}/{slot.name} has shape "
                                     f"{tuple(t.shape)}, expected {slot.shape}")
                view.copy_(t)
    with safe_open(os.path.join(loaded.path, "optimizer.safetensors"), framework="pt") as f:
        by_layer: dict[str, dict[str, torch.Tensor]] = {}
        for key in f.keys():
            layer, _, name = key.partition("/")
            by_layer.setdefault(layer, {})[name] = f.get_tensor(key)
    for plan in layout.layers:
        optimizers[plan.index].load_state_tensors(by_layer.get(plan.name, {}))
