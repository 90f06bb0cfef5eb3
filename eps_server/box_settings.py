"""The settings every box of a job must share, compared when the boxes join.

Each box's EPS and workers are started from the same job, but by hand, by a container or by
torchrun on each machine: a box given another learning rate updated its shard with it (the
served copies, gathered, still agreed, so the replica check saw nothing), one with more
workers or micro-batches counted a global batch of its own, one with other steps left the
others waiting. Now each EPS publishes what it trains with (its optimizer, precision, update
mode, workers, the model options and, from l2l-launch, the workers' settings) at the join, as
JSON in a byte tensor (nothing is unpickled), and a box whose settings differ from box 0's is
refused, on every box, saying which differ. Paths (a model's directory, data files, where
checkpoints go) may differ between machines and are not compared."""

from __future__ import annotations

import json

import torch

from .config import ServerConfig

MAX_BYTES = 1 << 20  # a box's settings (JSON): a larger claim is refused, not allocated
LOCAL = ("data", "eval_data", "init_from", "lora_init")  # files: where each machine has them


def shared(cfg: ServerConfig) -> dict:
    """What a box trains with that every box must share."""
    model = dict(cfg.model_record) if cfg.model_options else {}
    if str(model.get("model", "")).startswith("hf:"):
        model["model"] = "hf:"  # (the directory may lie elsewhere on each machine)
    job = json.loads(cfg.job_options) if cfg.job_options else {}
    return {"workers per box": cfg.world_size, "precision": cfg.precision,
            "update": cfg.update, "optimizer": cfg.optimizer.as_dict(),
            "eps mode": cfg.boxes.eps_mode, "box check every": cfg.boxes.box_check_every,
            "checkpoint every": cfg.checkpoint_every,
            "loss scale": [cfg.loss_scale, cfg.loss_scale_window] if cfg.precision == "fp16"
            else None,
            "model": {k: v for k, v in model.items() if k not in LOCAL},
            "job": {k: v for k, v in job.items() if k not in LOCAL}}


def differences(mine: dict, theirs: dict, where: str = "") -> list[str]:
    """``name: theirs vs mine`` for each setting that differs (maps compared key by key)."""
    out = []
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        name = f"{where}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{name}.")
        elif a != b:
            out.append(f"{name} {b!r} vs {a!r}")
    return out


def agree_on_settings(cfg: ServerConfig) -> None:
    """Compare this box's settings with box 0's (after the join; every box calls this).
    Raises ValueError naming the differences (a restart would meet them again), BoxLost when
    the boxes cannot be reached."""
    from .boxes import BoxLost, gathered

    nodes, me = cfg.boxes.nodes, cfg.boxes.node_rank
    mine = json.dumps(shared(cfg), sort_keys=True).encode()
    try:
        sizes = [int(s) for s in gathered(torch.tensor([len(mine)], dtype=torch.int64), nodes)]
        if max(sizes) > MAX_BYTES or min(sizes) < 0:
            raise ValueError(f"the boxes' settings take {sizes} bytes (at most {MAX_BYTES})")
        row = torch.zeros(max(sizes), dtype=torch.uint8)
        row[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        every = gathered(row, nodes)
    except ValueError:
        raise
    except Exception as e:  # gloo: a peer gone (connection closed) or the timeout
        raise BoxLost(f"the boxes could not compare their settings: {e}") from None
    try:
        first = json.loads(bytes(every[0][:sizes[0]].tolist()))
    except ValueError as e:
        raise ValueError(f"box 0's settings are not readable: {e}") from None
    if me == 0:  # (box 0 names the boxes that differ from it)
        for r in range(1, nodes):
            try:
                theirs = json.loads(bytes(every[r][:sizes[r]].tolist()))
            except ValueError:
                theirs = {}
            if said := differences(first, theirs):
                raise ValueError(f"box {r} runs the job with other settings than this box: "
                                 f"{'; '.join(said[:6])} (box {r}'s vs this one's): every box "
                                 "of a job must be started with the same")
    elif said := differences(first, json.loads(mine)):
        raise ValueError(f"this box runs the job with other settings than box 0: "
                         f"{'; '.join(said[:6])} (this box's vs box 0's): every box of a job "
                         "must be started with the same")
