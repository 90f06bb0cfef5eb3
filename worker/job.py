"""One worker's job: say Hello, bootstrap the EPS if asked, train, save, say Bye."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, replace

import torch

from protocol.curve import client_keys
from protocol.events import EvalDone, EventWriter, Joined, StepDone
from protocol.messages import WorkerReport
from protocol.shm import is_run_id
from protocol.tensors import Layout, named_views, plan_layout
from protocol.trace import Tracer

from .config import WorkerArgs
from .data import EvalSet, Sharder, build_eval, build_task
from .eps_client import EpsClient, EpsError
from .executor import Executor, StepResult
from .faults import Fault, parse_delays
from .memory import PeakMemory
from .models import build_model
from .models.loaders import flat_of
from .regions import Regions, layer_view
from .source import make_source

log = logging.getLogger("l2l_worker")


class RankLabel(logging.Filter):
    """Puts the worker's rank into each log record (``%(rank)s``): "?" until a worker started
    with --rank -1 is given one at the join."""

    rank = "?"

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


LOG_RANK = RankLabel()


def per_rank(path: str, rank: int) -> str:
    """``path`` with {rank} replaced by the rank (replicas started with --rank -1 share flags)."""
    return path.replace("{rank}", str(rank))

def summary_file(template: str, rank: int, run_id: str) -> str:
    """--summary-json with {rank} and {run} (the run id the EPS gave: l2l-launch --role
    worker's default path without --run-id) filled in."""
    if not is_run_id(run_id):  # as the EPS checks its own: a folder name, never a path
        raise EpsError("bad_message", f"the EPS's run id {run_id!r} is not a valid one",
                       "run_id")
    return per_rank(template, rank).replace("{run}", run_id)


INIT_IN_FLIGHT = 4  # initial layers in flight to the EPS while the next ones are loaded


def join(client: EpsClient, timeout: float, **hello):
    """Say Hello; while the rank is held by a predecessor the EPS has not declared dead yet
    ("rank_taken"), ask again until ``timeout``."""
    deadline = time.monotonic() + timeout
    told = False
    while True:
        try:
            return client.hello(timeout=max(1.0, deadline - time.monotonic()), **hello)
        except EpsError as e:
            if e.code != "rank_taken" or time.monotonic() > deadline:
                raise
            if not told:
                log.warning("rank %s: %s; waiting", hello["rank"] if hello["rank"] >= 0 else
                            "(any)", e.detail)
                told = True
            time.sleep(0.25)


def bootstrap(client: EpsClient, loader, layout: Layout, layers) -> None:
    """Send the initial fp32 values of ``layers``, a few in flight at a time, each assembled in
    one of a ring of buffers (the loader's tensors are views of the checkpoint file): memory
    stays at a few layers however deep the model, and nothing is allocated per layer."""
    ring = [torch.empty(layout.max_layer_numel) for _ in range(INIT_IN_FLIGHT)]
    in_flight = []
    for k, plan in enumerate(layout.layers[i] for i in layers):
        if len(in_flight) == len(ring):
            client.wait(in_flight.pop(0))  # its buffer is free again (the frame was sent)
        flat = flat_of(loader, plan, out=ring[k % len(ring)])
        in_flight.append(client.init_layer(plan.index, flat.numpy().data))
    for fut in in_flight:
        client.wait(fut)


def report(last: StepResult, samples: int, seconds: float, memory: PeakMemory) -> WorkerReport:
    """This worker's report after ``last`` (sent with its heartbeats; once per step), with
    the samples and seconds of its steps so far."""
    return WorkerReport(steps=last.step + 1, loss=last.mean_loss,
                        step_seconds=max(0.0, last.seconds),
                        fetch_wait=max(0.0, last.fetch_wait), push_wait=max(0.0, last.push_wait),
                        samples_per_sec=samples / seconds if seconds > 0 else 0.0,
                        memory=memory.current(), peak_memory=memory.value())


def save_model(client: EpsClient, regions: Regions, model, layout: Layout, version: int,
               path: str, metadata: dict) -> None:
    """Export the fp32 master at ``version`` in the model's own format (model.export)."""
    tensors, keep = {}, []
    for plan in layout.layers:
        ready, frames = client.wait(client.fetch(plan.index, version, which="master"))
        keep.append(frames)  # frames must outlive the views written below
        for name, view in named_views(layer_view(regions, plan, ready, frames), plan).items():
            tensors[plan.name, name] = view
    model.export(path, tensors, metadata)


def worker_device(device: str, rank: int) -> torch.device:
    """--device cuda spreads ranks over the GPUs this process sees; cpu and cuda:K are kept."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available here")
    if device == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return dev


def cap_device_memory(device: torch.device, gib: float) -> None:
    """--device-memory-gib: the caching allocator refuses to hold more than ``gib`` GiB."""
    if gib:
        total = torch.cuda.get_device_properties(device).total_memory
        if gib * 2**30 > total:
            raise ValueError(f"--device-memory-gib {gib}: {device} has only "
                             f"{total / 2**30:.1f} GiB")
        torch.cuda.set_per_process_memory_fraction(gib * 2**30 / total, device)


def run_worker(args: WorkerArgs) -> dict:
    """Train; returns this worker's summary (also written to --summary-json)."""
    cfg, mcfg = args.worker, args.model
    keys = client_keys(cfg.curve_server_key, cfg.curve_key)  # a bad key fails before any work
    torch.set_num_threads(cfg.threads)
    worker_device(cfg.device, max(cfg.rank, 0))  # a bad device fails before the join
    model = build_model(mcfg)
    # The data is read and checked before the job is joined: a bad file costs nobody a step.
    task = build_task(model, args.data, micro_batch_size=cfg.micro_batch_size,
                      global_micro_batches=cfg.global_micro_batches)
    evalset = build_eval(model, args.data, cfg.micro_batch_size, max(cfg.rank, 0),
                         cfg.world_size)
    manifest = model.manifest()
    layout = plan_layout(manifest)
    # a bad path fails before the join, unless it names the rank (known after the join)
    events = None if "{rank}" in cfg.events else EventWriter(cfg.events)
    client = EpsClient(cfg.endpoint, cfg.eps_timeout, curve=keys)
    source = welcome = tracer = memory = None
    summary_path = ""
    results: list[StepResult] = []
    evals: list[dict] = []
    done = False
    elapsed, peak = 0.0, 0
    try:
        log.info("saying Hello to the EPS at %s (waiting for it up to %g s)", cfg.endpoint,
                 cfg.eps_timeout)  # started before it, a worker would otherwise say nothing
        welcome = join(client, cfg.eps_timeout, rank=cfg.rank,
                       world_size=cfg.world_size, manifest=manifest, transport=cfg.transport,
                       grad_dtype=cfg.grad_dtype)
        if not 0 <= welcome.rank < cfg.world_size:
            raise EpsError("bad_message", f"the EPS assigned rank {welcome.rank}", "rank")
        if cfg.rank != welcome.rank:  # asked for any rank (-1): this is the one assigned
            cfg = replace(cfg, rank=welcome.rank)
            if evalset is not None:
                evalset = EvalSet(evalset.task, cfg.micro_batch_size, cfg.rank, cfg.world_size)
        LOG_RANK.rank = str(cfg.rank)
        if cfg.summary_json:  # its folder made now: an unwritable one fails before training
            summary_path = summary_file(cfg.summary_json, cfg.rank, welcome.run_id)
            os.makedirs(os.path.dirname(os.path.abspath(summary_path)), exist_ok=True)
        events = events or EventWriter(per_rank(cfg.events, cfg.rank))
        device = worker_device(cfg.device, cfg.rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            cap_device_memory(device, cfg.device_memory_gib)
        memory = PeakMemory(device)  # from before the bootstrap: the whole life of the worker
        tracer = Tracer(per_rank(cfg.trace, cfg.rank), f"l2l-worker {cfg.rank}")
        client.start_heartbeats(welcome.heartbeat_interval, cfg.stall_timeout)
        events.emit(Joined(rank=cfg.rank, pid=os.getpid(), step=welcome.step,
                           pushed=len(welcome.pushed), rejoined=welcome.rejoined))
        log.info("rank %d: %s run %s at step %d on %s (%d layers, %.2fM params, compute %s, "
                 "gradients %s)%s", cfg.rank, "rejoined" if welcome.rejoined else "joined",
                 welcome.run_id, welcome.step, device, len(layout.layers),
                 manifest.num_params / 1e6, welcome.compute_dtype, welcome.grad_dtype,
                 f"; {len(welcome.pushed)} layers of it pushed already" if welcome.pushed
                 else "")
        if welcome.init_layers:
            t0 = time.perf_counter()
            bootstrap(client, model.loader(), layout, welcome.init_layers)
            model.drop_loader()  # its files stay mapped only while they are read
            log.info("rank %d: initialised the EPS in %.2f s", cfg.rank, time.perf_counter() - t0)
        sharder = Sharder(task, cfg.micro_batch_size, cfg.global_micro_batches)
        source = make_source(client, welcome, layout, cfg, device, tracer)
        executor = Executor(model, layout, source, sharder, device=device,
                            micro_batches=cfg.my_micro_batches(), steps=cfg.steps,
                            dropout=model.dropout, seed=mcfg.seed, stash=cfg.stash,
                            tracer=tracer, layer_drop=cfg.layer_drop,
                            cuda_delays=parse_delays(cfg.cuda_delay),
                            fault=None if welcome.rejoined else Fault.parse(cfg.fault,
                                                                            cfg.rank))
        eval_batches = evalset.batches() if evalset is not None else []
        eval_seconds = 0.0

        def evaluate(version: int) -> None:
            nonlocal eval_seconds
            t0 = time.perf_counter()
            loss, correct, count = executor.evaluate(version, eval_batches,
                                                     prefetch_after=version < cfg.steps)
            evals.append({"step": version, "loss_sum": loss, "correct": correct,
                          "count": count})
            events.emit(EvalDone(rank=cfg.rank, step=version, loss_sum=loss, correct=correct,
                                 count=count, objective=model.objective))
            eval_seconds += time.perf_counter() - t0

        t_start = time.perf_counter()
        trained_samples, trained_seconds = 0, 0.0  # of this worker's steps
        if evalset is not None and not welcome.rejoined:  # (a replacement: the others did)
            evaluate(welcome.step)  # before training (on resume: where it stands)
        for step in range(welcome.step, cfg.steps):
            r = executor.run_step(step, frozenset(welcome.pushed) if step == welcome.step
                                  else frozenset())
            results.append(r)
            trained_samples += r.samples
            trained_seconds += r.seconds
            try:
                client.report(report(r, trained_samples, trained_seconds, memory))
            except ValueError as e:  # a figure out of range: the report is skipped, not the step
                log.debug("no report for step %d: %s", r.step, e)
            events.emit(StepDone(rank=cfg.rank, step=r.step, loss=r.loss, correct=r.correct,
                                 count=r.count, samples=r.samples, seconds=r.seconds,
                                 fetch_wait=round(r.fetch_wait, 6),
                                 push_wait=round(r.push_wait, 6)))
            executor.point(step, "E")
            every = args.data.eval_every
            if evalset is not None and (step + 1 == cfg.steps or every and (step + 1) % every
                                        == 0):
                evaluate(step + 1)
        elapsed = time.perf_counter() - t_start - eval_seconds
        peak = memory.value()
        if cfg.save and cfg.rank == 0:
            save_model(client, source.regions, model, layout, cfg.steps, cfg.save,
                       {"format": "pt", "model_config": json.dumps(asdict(mcfg)),
                        "steps": str(cfg.steps)})
            log.info("rank 0: model saved to %s", cfg.save)
        done = True
    finally:
        if memory is not None:
            memory.close()
        if welcome is not None:  # the EPS drops this worker's waiting Fetches
            client.bye(cfg.rank, done=done)
        client.close()  # fails whatever is still pending, so helper threads can finish
        if source is not None:
            source.close()
        if tracer is not None:
            tracer.close()
        if events is not None:
            events.close()
    samples = sum(r.samples for r in results)
    summary = {
        "rank": cfg.rank, "world_size": cfg.world_size, "device": str(device), "pid": os.getpid(),
        "first_step": results[0].step if results else cfg.steps,
        "steps": len(results), "losses": [r.mean_loss for r in results],
        "correct": [r.correct for r in results], "counts": [r.count for r in results],
        "step_seconds": [r.seconds for r in results], "samples": samples,
        "seconds": elapsed, "samples_per_sec": samples / elapsed if elapsed > 0 else 0.0,
        "peak_memory_bytes": peak, "model": asdict(mcfg), "data": asdict(args.data),
        "objective": model.objective,
        "fetches_without_round_trip": source.fast_fetches, "evals": evals,
        "pinned_regions": source.regions.registered, "unpinned_regions": source.regions.refused,
        "config": {k: v for k, v in asdict(cfg).items() if k != "endpoint"},
    }
    if summary_path:
        with open(summary_path, "w") as f:
            json.dump(summary, f, indent=1)
    return summary
