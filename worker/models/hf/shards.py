"""A Hugging Face model's weights written as ``save_pretrained`` writes them: one
``model.safetensors`` while they fit in ``max_shard_size``, else ``model-0000K-of-0000N``
files and ``model.safetensors.index.json`` (the weight map, total size and parameter count).
Tensors keep the given order (a model's layers in order) and fill a file until the next would
overflow it; a tensor larger than the limit gets a file of its own.

Every weight file and the index are written under temporary names first, then renamed (the
index last), and the files of an earlier export that the new one does not overwrite are
removed: a failed write removes what it wrote and leaves the earlier export's weights as they
were. (The config is written after the weights: an export interrupted between the two leaves
new weights beside the earlier config.) An export killed while it writes leaves its temporary
files; the next export into the directory from the same host removes them (a process is
judged alive or gone only on its own host: containers may share the directory).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
from collections.abc import Collection

import torch

from protocol.safetensors_io import write_safetensors, written_dtype

log = logging.getLogger("l2l_worker")

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# what an export writes under a temporary name, with its pid and host (write_safetensors
# adds .tmp-<pid>)
PARTIAL = re.compile(r"\.?model[^/]*\.partial-(\d+)(?:-([A-Za-z0-9_.]+?))?(?:\.tmp-\d+)?")


def _owner() -> str:
    """This process as a temporary name holds it: pid and host (file-name safe)."""
    return f"{os.getpid()}-{_host()}"


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())


def nbytes(t: torch.Tensor, dtype: torch.dtype | None, kept: bool = False) -> int:
    return t.numel() * written_dtype(t, dtype, kept).itemsize


def split(named: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None,
          max_bytes: int, keep: Collection[str] = ()) -> list[list[tuple[str, torch.Tensor]]]:
    """``named`` in files of at most ``max_bytes`` (each at least one tensor), in order."""
    files: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in named:
        n = nbytes(t, dtype, name in keep)
        if files[-1] and size + n > max_bytes:
            files.append([])
            size = 0
        files[-1].append((name, t))
        size += n
    return files


def file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_weights(path: str, named: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None,
                  max_bytes: int, metadata: dict[str, str],
                  keep: Collection[str] = ()) -> list[str]:
    """Write ``named`` (the library's names, in order) into the directory ``path``, floating
    point in ``dtype`` but for the names in ``keep``; returns the files' names."""
    remove_leftovers(path)
    files = split(named, dtype, max_bytes, keep)
    names = file_names(len(files))
    partial = [os.path.join(path, f".{n}.partial-{_owner()}") for n in names]
    index = os.path.join(path, INDEX)
    index_tmp = f"{index}.partial-{_owner()}"
    try:  # every file, the index too, under a temporary name before any rename
        for tensors, tmp in zip(files, partial):
            write_safetensors(tmp, tensors, metadata, dtype=dtype, keep=keep)
        if len(names) > 1:
            weight_map = {n: f for f, tensors in zip(names, files) for n, _ in tensors}
            with open(index_tmp, "w") as f:
                size = sum(nbytes(t, dtype, n in keep) for n, t in named)
                json.dump({"metadata": {"total_parameters": sum(t.numel() for _, t in named),
                                        "total_size": size},
                           "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
                f.write("\n")
    except BaseException:
        for tmp in [*partial, index_tmp]:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        raise
    for tmp, name in zip(partial, names):
        os.replace(tmp, os.path.join(path, name))
    if len(names) > 1:
        os.replace(index_tmp, index)
    stale = [f for f in os.listdir(path) if f not in names and (
        SHARD.fullmatch(f) or f == SINGLE or (f == INDEX and len(names) == 1))]
    for f in stale:
        os.remove(os.path.join(path, f))
    return names


def remove_leftovers(path: str) -> None:
    """The temporary files of an export that was killed while it wrote into ``path`` (its
    process gone; a live one's, or another host's, are left to it)."""
    others = []
    for f in os.listdir(path):
        m = PARTIAL.fullmatch(f)
        if m and m.group(2) not in (_host(), None):
            others.append(f)
        elif m and not _alive(int(m.group(1))):
            try:
                os.remove(os.path.join(path, f))
            except FileNotFoundError:
                pass
    if others:  # (a container's host name changes when it is made again: say what is left)
        size = sum(os.path.getsize(os.path.join(path, f)) for f in others
                   if os.path.exists(os.path.join(path, f)))
        log.warning("%s holds %d temporary export files of another host (%s, %.1f GB): left "
                    "to it; remove them if no export from there is running", path, len(others),
                    others[0], size / 1e9)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's)
        pass
    return True
