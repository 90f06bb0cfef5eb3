"""One part of a job per process (``l2l-launch --role eps|worker``), for containers: every
container reads the same job file and runs its part in the foreground, logging to stderr.
The children of ``--role all`` get their configs from the same two functions."""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import replace

from eps_server.config import ServerConfig, available_cores
from protocol import cli
from protocol.checkpoints import is_root
from worker.config import WorkerArgs

from .config import LaunchArgs
from .rundir import publish_endpoint, withdraw_endpoint


def server_config(args: LaunchArgs, endpoint: str, run_id: str, trace: str = "") -> ServerConfig:
    """The EPS of this job: world size from --workers, recovery on with --max-restarts, and
    (--server-threads 0) the cores its workers' --threads leave (the workers of a container
    job share the box as well). It records the model options in its checkpoints, for
    l2l-export (an hf: model's directory as an absolute path: export may run elsewhere), and
    with several boxes compares them and the workers' settings with the other boxes'."""
    a, model = args.launch, args.model
    threads = args.server.threads or max(1, available_cores() - a.workers * args.worker.threads)
    if model.model.startswith("hf:"):
        model = replace(model, model="hf:" + os.path.abspath(model.model[3:]))
    w, d = args.worker, args.data
    job = {"steps": w.steps, "micro_batches": w.micro_batches, "layer_drop": w.layer_drop,
           "micro_batch_size": w.micro_batch_size, "grad_dtype": w.grad_dtype,
           "data": {k: v for k, v in cli.to_dict(d).items() if k not in ("data", "eval_data")}}
    return replace(args.server, endpoint=endpoint, world_size=a.workers, run_id=run_id,
                   exit_when_done=True, recovery=args.server.recovery or a.max_restarts > 0,
                   trace=trace, threads=threads, model_options=json.dumps(cli.to_dict(model)),
                   job_options=json.dumps(job))


def worker_args(args: LaunchArgs, endpoint: str, rank: int, summary_json: str,
                trace: str = "") -> WorkerArgs:
    """Worker ``rank`` (-1: any free rank) of this box; box 0's rank 0 saves the model
    (--save)."""
    a, boxes = args.launch, args.server.boxes
    w = replace(args.worker, endpoint=endpoint, rank=rank, world_size=a.workers,
                box=boxes.node_rank, boxes=boxes.nodes,
                save=os.path.abspath(a.save) if a.save and rank in (0, -1)
                and boxes.node_rank == 0 and not exports_checkpoint(args) else "",
                summary_json=summary_json, trace=trace)
    return WorkerArgs(worker=w, model=args.model, data=args.data)


def exports_checkpoint(args: LaunchArgs) -> bool:
    """--save is written by box 0's launcher from the final checkpoint, not by a worker: in
    shard mode with bf16/fp16 compute no box holds the whole fp32 master to serve."""
    s = args.server
    return bool(args.launch.save) and s.boxes.sharding is not None and s.precision != "fp32"


def under_torchrun(args: LaunchArgs, env=os.environ) -> LaunchArgs:
    """l2l-launch started by torchrun (``--nnodes N --nproc-per-node 1``) on each box: the
    boxes are its nodes (WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT), and the EPSes join
    through torchrun's own store (env://). --nodes on the command line wins."""
    if args.server.boxes.nodes > 1 or "TORCHELASTIC_RUN_ID" not in env:
        return args
    nodes, rank = int(env.get("WORLD_SIZE", "1")), int(env.get("RANK", "0"))
    if int(env.get("LOCAL_WORLD_SIZE", "1")) != 1:
        raise ValueError("under torchrun, start l2l-launch once per box: --nproc-per-node 1 "
                         "(l2l-launch starts the box's workers itself)")
    boxes = replace(args.server.boxes, nodes=nodes, node_rank=rank, rendezvous="env",
                    master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                    master_port=int(env.get("MASTER_PORT", "29500")))
    return replace(args, server=replace(args.server, boxes=boxes))


def run_role(args: LaunchArgs) -> int:
    a = args.launch
    if a.role == "eps":
        from eps_server.__main__ import run

        run_id = a.run_id or secrets.token_hex(4)
        run_dir = os.path.join(a.runs_dir, run_id)
        os.makedirs(run_dir, exist_ok=True)
        cfg = server_config(args, a.endpoint or args.server.endpoint, run_id)
        if cfg.save and _has_checkpoints(cfg.save):
            # A restarted EPS (its container's restart policy) continues from its last
            # checkpoint, not from the job's --load; workers that lost it rejoin at that step.
            # Loaded as --load is, so a damaged one is refused, naming the file (taken for
            # no checkpoint, the run started again from step 0 and pruned it).
            cfg = replace(cfg, load=cfg.save)
        cli.write_file(args, os.path.join(run_dir, "config.json"))  # the job as resolved
        publish_endpoint(run_dir, cfg.endpoint)  # for l2l-ctl status in this container
        try:
            return run(cfg)
        finally:
            withdraw_endpoint(run_dir)
    from worker.__main__ import run

    # One summary per worker (no launcher sums them up here): --summary-json with {rank} in
    # it, or its name with -{rank} before the extension, else in the run directory (without
    # --run-id, the worker learns the run's id from the EPS: {run}).
    summary = os.path.join(a.runs_dir, a.run_id or "{run}", "worker-{rank}.json")
    if a.summary_json:
        stem, ext = os.path.splitext(a.summary_json)
        summary = a.summary_json if "{rank}" in a.summary_json else f"{stem}-{{rank}}{ext}"
    return run(worker_args(args, a.endpoint or args.worker.endpoint, a.rank, summary))


def _has_checkpoints(root: str) -> bool:
    try:
        return os.path.isdir(root) and is_root(root)
    except OSError:  # unreadable: the EPS says so as it takes the folder
        return False
