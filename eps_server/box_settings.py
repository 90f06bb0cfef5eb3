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
import os
import secrets

import torch

from .config import ServerConfig

MAX_BYTES = 1 << 20  # a box's settings (JSON): a larger claim is refused, not allocated
# Not compared: files (where each machine has them), what only box 0 does (it writes --save)
# and evaluation (each box's launcher evaluates its own workers).
LOCAL = ("data", "eval_data", "init_from", "lora_init", "merge", "save_dtype",
         "save_max_shard_size", "eval_every")


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
            "job": {k: v for k, v in job.items() if k not in LOCAL} | (
                {"data": {k: v for k, v in job["data"].items() if k not in LOCAL}}
                if isinstance(job.get("data"), dict) else {})}


def differences(mine: dict, theirs: dict, where: str = "") -> list[str]:
    """``name: theirs vs mine`` for each setting that differs (maps compared key by key)."""
    out = []
    for key in sorted(k for k in set(mine) | set(theirs) if not k.startswith("_")):
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
    me = cfg.boxes.node_rank
    settings = shared(cfg)
    marker = ""  # shard mode: box 0 marks its --server-save, which every box must see
    if cfg.save and cfg.boxes.sharding is not None and me == 0:
        marker = f".boxes.tmp-{secrets.token_hex(8)}"  # (a leftover is removed as ours)
        open(os.path.join(cfg.save, marker), "w").close()
        settings["_folder"] = marker
    try:
        every = _exchange(cfg, json.dumps(settings, sort_keys=True).encode())
        _compare(cfg, every)
        _same_folder(cfg, every[0].get("_folder", ""))
    finally:
        if marker:
            os.unlink(os.path.join(cfg.save, marker))


def _exchange(cfg: ServerConfig, mine: bytes) -> list[dict]:
    """Every box's settings, in box order ({} for one that cannot be read)."""
    from .boxes import BoxLost, gathered

    nodes = cfg.boxes.nodes
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
    out = []
    for row, size in zip(every, sizes):
        try:
            out.append(json.loads(bytes(row[:size].tolist())))
        except ValueError:
            out.append({})
    return out


def _compare(cfg: ServerConfig, every: list[dict]) -> None:
    """Every box compares every box with box 0 (so that all refuse, or none)."""
    me, first = cfg.boxes.node_rank, every[0]
    for r in range(1, len(every)):
        # (an EPS started by hand knows no model or workers' options: those are not compared)
        unknown = [k for k in ("model", "job") if not first.get(k) or not every[r].get(k)]
        if said := differences(*({k: v for k, v in side.items() if k not in unknown}
                                 for side in (first, every[r]))):
            who, than = (("this box", "box 0") if r == me else
                         (f"box {r}", "this box" if me == 0 else "box 0"))
            raise ValueError(f"{who} runs the job with other settings than {than}: "
                             f"{'; '.join(said[:6])} ({who}'s vs {than}'s): every box of a job "
                             "must be started with the same")


def _same_folder(cfg: ServerConfig, marker: str) -> None:
    """Shard mode: the boxes write each checkpoint together into one folder; a box that does
    not see box 0's (no shared file system) failed every checkpoint, and the job exited 0
    with none. Every box says whether it sees box 0's marker; any that does not is refused
    on every box."""
    from .boxes import BoxLost, gathered

    if not marker:
        return
    sees = os.path.isfile(os.path.join(cfg.save, marker))
    try:
        seen = [int(s) for s in gathered(torch.tensor([int(sees)], dtype=torch.int64),
                                         cfg.boxes.nodes)]
    except Exception as e:
        raise BoxLost(f"the boxes could not compare their --server-save: {e}") from None
    if blind := [r for r, s in enumerate(seen) if not s]:
        raise ValueError(f"--server-save {cfg.save}: box(es) {blind} do not see box 0's folder "
                         "there; in --eps-mode shard the boxes write each checkpoint together "
                         "into one folder every box sees (a shared file system)")
