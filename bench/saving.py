"""Checkpoint files as the EPS writes and reads them: written at once, each hashed as its bytes
are written, against one after the other, each read back to be hashed (as they were written
before); and verified at once against one after the other. The files are an AdamW checkpoint's
two, the master (4 B a parameter) and the optimizer's moments (8 B), written under ``--dir``
(fsynced: the disk's speed is in both) and timed in interleaved rounds. Where the disk is slow
the write sets both paces; where it is faster than a thread's sha256 (~1 GB/s), hashing did.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import torch

from eps_server.checkpoint import write_tensor_files
from protocol.checkpoints import sha256_file, verify
from protocol.safetensors_io import write_safetensors

from .common import check, interleaved, table


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=int, default=50_000_000, help="parameters checkpointed")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default="", help="where to write (default: a temporary folder "
                   "under the working directory, on its disk rather than in memory)")


def _one_by_one(tmp: str, files) -> dict:
    """The writer before: each file written, then read back to be hashed."""
    sums = {}
    for file, tensors in files:
        path = os.path.join(tmp, file)
        write_safetensors(path, tensors)
        sums[file] = {"sha256": sha256_file(path), "size": os.path.getsize(path)}
    return sums


def _verify_one_by_one(tmp: str, sums: dict) -> None:
    for file, want in sums.items():
        assert sha256_file(os.path.join(tmp, file)) == want["sha256"]


def saving(a) -> dict:
    n = a.params
    files = [("master.safetensors", [("w", torch.randn(n))]),
             ("optimizer.safetensors", [("m", torch.randn(n)), ("v", torch.rand(n))])]
    gib = 12 * n / 2**30
    with tempfile.TemporaryDirectory(prefix="l2l-saving-", dir=a.dir or os.getcwd()) as tmp:
        dirs = {name: os.path.join(tmp, name) for name in ("now", "before")}

        def fresh(name: str) -> str:
            shutil.rmtree(dirs[name], ignore_errors=True)
            os.makedirs(dirs[name])
            return dirs[name]

        written = interleaved({"now": lambda: write_tensor_files(fresh("now"), files),
                               "before": lambda: _one_by_one(fresh("before"), files)},
                              reps=a.reps, warmup=1)
        sums = write_tensor_files(fresh("now"), files)
        with open(os.path.join(dirs["now"], "checksums.json"), "w") as f:
            json.dump(sums, f)
        read = interleaved({"now": lambda: verify(dirs["now"]),
                            "before": lambda: _verify_one_by_one(dirs["now"], sums)},
                           reps=a.reps, warmup=1)
    rows = [["write + checksums", f"{written['now']:.2f}", f"{written['before']:.2f}",
             f"{gib / written['now']:.2f}", f"{written['before'] / written['now']:.2f}x"],
            ["verify checksums", f"{read['now']:.2f}", f"{read['before']:.2f}",
             f"{gib / read['now']:.2f}", f"{read['before'] / read['now']:.2f}x"]]
    return {"table": table(f"checkpoint files: {n / 1e6:.0f}M parameters, {gib:.2f} GiB "
                           "(master + AdamW moments)",
                           ["", "now s", "before s", "now GiB/s", "speed-up"], rows),
            "write_seconds": written, "verify_seconds": read, "gib": gib,
            "targets": [check("write: before / now", written["before"] / written["now"],
                              ">=", 1.0),
                        check("verify: before / now", read["before"] / read["now"], ">=", 1.0)]}
