"""A checkpoint of an ``--eps-mode shard`` job, written by every box together into one
checkpoint folder that every box sees (a shared file system, as sharded checkpoints of
DeepSpeed or torch.distributed.checkpoint need):

1. at the same step boundary on every box (engines parked: no other collective runs), box 0
   makes the temporary folder ``.step-<t>.tmp-shards`` under the root it holds;
2. each box writes its span of every layer (master, optimizer state: protocol/
   checkpoint_tensors.py) and its files' checksums travel to box 0 over the boxes' group;
3. box 0 writes the one set of metadata (manifest, state with ``"shards": N``, the checksums
   of every box's files), renames the folder into place and moves ``latest``, as one EPS's
   checkpoint does (checkpoint.py): atomic as a whole, the previous checkpoint stands until
   then; every box learns the outcome.

A box that fails to write fails the checkpoint on every box (the next one is tried); a box
that is gone fails it within --box-timeout and stops the job (boxes.py).
"""

from __future__ import annotations

import errno
import os
import shutil

import numpy as np
import torch

from protocol import checkpoints as layout_on_disk
from protocol.checkpoint_tensors import shard_files

from .checkpoint import _new_name, commit, master_views, write_metadata, write_tensor_files

_ROW = 11  # ok, two sizes, two sha256 as 4 int64 each


def save_shards(root: str, store, optimizers, extra: dict, keep: int, boxes) -> str:
    sharding, step = store.sharding, store.step
    lead = sharding.rank == 0
    what = f"the checkpoint of step {step}"
    tmp = os.path.join(root, f".{layout_on_disk.step_name(step)}.tmp-shards")
    error: OSError | None = None
    if lead:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp, mode=0o700)
        except OSError as e:
            error = e
    if not boxes.agree(torch.tensor([int(error is None)]), what)[0, 0]:
        raise error or OSError(errno.EIO, f"box 0 could not make {tmp} for {what}")
    files = shard_files(sharding.rank, sharding.count)
    row = torch.zeros(_ROW, dtype=torch.int64)
    try:
        master, state = [], []
        for plan in store.layout.layers:
            master.append((f"{plan.name}/master", store.master(plan.index)))
            if lead:  # --freeze: the frozen tensors, once (every box serves the same)
                master += [(f"{plan.name}/{slot.name}", view)
                           for slot, view in master_views(store, plan, frozen=True)]
            for key, t in optimizers[plan.index].state_tensors().items():
                state.append((f"{plan.name}/{key}", t))
        sums = write_tensor_files(tmp, zip(files, (master, state)))
        row[0] = 1
        row[1:3] = torch.tensor([sums[f]["size"] for f in files])
        row[3:] = torch.from_numpy(np.frombuffer(b"".join(
            bytes.fromhex(sums[f]["sha256"]) for f in files), dtype="<i8").copy())
    except OSError as e:
        error = e
    rows = boxes.agree(row, what)
    failed = [r for r in range(sharding.count) if not rows[r, 0]]
    if failed and lead:
        shutil.rmtree(tmp, ignore_errors=True)
    if failed:
        raise error or OSError(errno.EIO, f"box(es) {failed} could not write their part of "
                                          f"{what} (their EPS logs say why)")
    name, k = "", -1
    if lead:
        try:
            sums = {}
            for r in range(sharding.count):
                digests = rows[r, 3:].numpy().astype("<i8").tobytes()
                for i, f in enumerate(shard_files(r, sharding.count)):
                    sums[f] = {"sha256": digests[32 * i:32 * i + 32].hex(),
                               "size": int(rows[r, 1 + i])}
            write_metadata(tmp, store, {**extra, "shards": sharding.count}, sums)
            name = _new_name(root, layout_on_disk.step_name(step))
            commit(root, tmp, name, keep)
            k = int(name.rpartition("-")[2]) if name.count("-") > 1 else 0
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error = e
    outcome = int(boxes.agree(torch.tensor([k], dtype=torch.int64), what)[0, 0])
    if outcome < 0:
        raise error or OSError(errno.EIO, f"box 0 could not complete {what} (its log says "
                                          "why)")
    base = layout_on_disk.step_name(step)
    return os.path.join(root, f"{base}-{outcome}" if outcome else base)
