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
from protocol.tensors import DTYPES, Layout, named_views, plan_layout
from protocol.trace import Tracer

from .config import WorkerArgs
from .data import EvalSet, Sharder, build_eval, build_task
from .eps_client import EpsClient, EpsError
from .executor import Executor, StepResult
from .faults import Fault, parse_delays
from .keep import GraphBudget
from .memory import PeakMemory
from .models import build_model
from .models.loaders import init_frame
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


def bootstrap(client: EpsClient, loader, layout: Layout, layers, compute: str) -> None:
    """Send the initial values of ``layers`` (fp32; a layer's frozen tensors in the
    ``compute`` dtype, the only copy the EPS keeps of them), a few in flight at a time, each
    assembled in one of a ring of buffers (the loader's tensors are views of the checkpoint
    file): memory stays at a few layers however deep the model, and nothing is allocated per
    layer."""
    ring = [torch.empty(4 * layout.max_layer_numel, dtype=torch.uint8)
            for _ in range(INIT_IN_FLIGHT)]
    in_flight = []
    for k, plan in enumerate(layout.layers[i] for i in layers):
        if len(in_flight) == len(ring):
            client.wait(in_flight.pop(0))  # its buffer is free again (the frame was sent)
        frozen = compute if plan.trainable < plan.numel else "float32"
        frame = init_frame(loader, plan, ring[k % len(ring)], DTYPES[frozen])
        in_flight.append(client.init_layer(plan.index, frame.numpy().data, frozen))
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
    """Export the fp32 master at ``version`` in the model's own format (model.export); of a
    layer whose exported tensors all train (a LoRA adapter's), only its trainable part."""
    tensors, keep = {}, []
    for plan in layout.layers:
        names = model.exported(plan)  # (a LoRA adapter: its own tensors only)
        if not names:
            continue
        trained = not plan.frozen_names.intersection(names)
        ready, frames = client.wait(client.fetch(plan.index, version,
                                                 which="trained" if trained else "master"))
        views = named_views(layer_view(regions, plan, ready, frames, trained), plan,
                            names if trained else None)
        # Views of the whole layer, but copies of a part of it, or of a received frame with
        # frozen tensors (an export may replace them with their exact values, unrounded: the
        # frame is let go then, not held beside them).
        share = len(names) == len(plan.tensors) and (trained or not frames)
        if share:
            keep.append(frames)  # frames must outlive the views written below
        for name in names:
            tensors[plan.name, name] = views[name] if share else views[name].clone()
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


class ModelNotSaved(Exception):
    """--save could not be written (the trained weights are still on the EPS)."""


class WorkerJob:
    """One worker's life, in the order its methods run: ``join`` the EPS's job, ``bootstrap``
    the EPS's weights if asked, ``train`` (evaluating when due), ``save`` the model (rank 0),
    ``leave``; ``run`` strings them together with the teardown in one place. What can be
    checked before the join (options, device, model, data, files) is, in the constructor: a
    bad one costs nobody a step."""

    def __init__(self, args: WorkerArgs):
        self.args, self.cfg, self.mcfg = args, args.worker, args.model
        cfg = self.cfg
        self.keys = client_keys(cfg.curve_server_key, cfg.curve_key)
        torch.set_num_threads(cfg.threads)
        worker_device(cfg.device, max(cfg.rank, 0))
        self.model = build_model(self.mcfg)
        self.task = build_task(self.model, args.data, micro_batch_size=cfg.micro_batch_size,
                               global_micro_batches=cfg.global_micro_batches)
        self.evalset = build_eval(self.model, args.data, cfg.micro_batch_size,
                                  cfg.box * cfg.world_size + max(cfg.rank, 0),
                                  cfg.boxes * cfg.world_size)
        self.manifest = self.model.manifest()
        self.layout = plan_layout(self.manifest)
        # a bad path fails before the join, unless it names the rank (known after the join)
        self.events = None if "{rank}" in cfg.events else EventWriter(cfg.events)
        self.client = EpsClient(cfg.endpoint, cfg.eps_timeout, curve=self.keys)
        self.source = self.welcome = self.tracer = self.memory = self.executor = None
        self.device = torch.device(cfg.device)
        self.summary_path = ""
        self.results: list[StepResult] = []
        self.evals: list[dict] = []
        self.eval_batches: list = []
        self.eval_seconds = 0.0
        self.done = False
        self.elapsed, self.peak = 0.0, 0

    def run(self) -> dict:
        """Train; returns this worker's summary (also written to --summary-json)."""
        try:
            self.join()
            self.bootstrap()
            self.train()
            self.save()
            self.done = True
        finally:
            self.leave()
        return self.summary()

    def join(self) -> None:
        """Hello (the EPS assigns the rank where it was -1), then the per-rank set-up."""
        cfg = self.cfg
        log.info("saying Hello to the EPS at %s (waiting for it up to %g s)", cfg.endpoint,
                 cfg.eps_timeout)  # started before it, a worker would otherwise say nothing
        self.welcome = welcome = join(
            self.client, cfg.eps_timeout, rank=cfg.rank, world_size=cfg.world_size,
            manifest=self.manifest, transport=cfg.transport, grad_dtype=cfg.grad_dtype,
            samples_per_step=cfg.micro_batch_size * cfg.global_micro_batches)
        if hasattr(self.task, "origin"):  # a file's records: where the job stands in them
            self.task.origin = (welcome.data_step, welcome.data_samples)
            if welcome.step:
                log.info("step %d starts at sample %d of the data", welcome.step,
                         self.task.first_position(welcome.step))
        if not 0 <= welcome.rank < cfg.world_size:
            raise EpsError("bad_message", f"the EPS assigned rank {welcome.rank}", "rank")
        if cfg.rank != welcome.rank:  # asked for any rank (-1): this is the one assigned
            cfg = self.cfg = replace(cfg, rank=welcome.rank)
            if self.evalset is not None:
                self.evalset = EvalSet(self.evalset.task, cfg.micro_batch_size, cfg.global_rank,
                                       cfg.boxes * cfg.world_size)
        LOG_RANK.rank = str(cfg.rank)
        if cfg.summary_json:  # its folder made now: an unwritable one fails before training
            self.summary_path = summary_file(cfg.summary_json, cfg.rank, welcome.run_id)
            os.makedirs(os.path.dirname(os.path.abspath(self.summary_path)), exist_ok=True)
        self.events = self.events or EventWriter(per_rank(cfg.events, cfg.rank))
        self.device = device = worker_device(cfg.device, cfg.rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            cap_device_memory(device, cfg.device_memory_gib)
        self.memory = PeakMemory(device)  # from before the bootstrap: the worker's whole life
        self.tracer = Tracer(per_rank(cfg.trace, cfg.rank), f"l2l-worker {cfg.rank}")
        self.client.start_heartbeats(welcome.heartbeat_interval, cfg.stall_timeout)
        self.events.emit(Joined(rank=cfg.rank, pid=os.getpid(), step=welcome.step,
                                pushed=len(welcome.pushed), rejoined=welcome.rejoined))
        log.info("rank %d: %s run %s at step %d on %s (%d layers, %.2fM params, compute %s, "
                 "gradients %s)%s", cfg.rank, "rejoined" if welcome.rejoined else "joined",
                 welcome.run_id, welcome.step, device, len(self.layout.layers),
                 self.manifest.num_params / 1e6, welcome.compute_dtype, welcome.grad_dtype,
                 f"; {len(welcome.pushed)} layers of it pushed already" if welcome.pushed
                 else "")

    def bootstrap(self) -> None:
        """Send the EPS the initial weights it asked this worker for; then the loop's parts."""
        cfg, welcome = self.cfg, self.welcome
        if welcome.init_layers:
            t0 = time.perf_counter()
            bootstrap(self.client, self.model.loader(getattr(torch, welcome.compute_dtype)),
                      self.layout, welcome.init_layers, welcome.compute_dtype)
            self.model.drop_loader()  # its files stay mapped only while they are read
            log.info("rank %d: initialised the EPS in %.2f s", cfg.rank, time.perf_counter() - t0)
        sharder = Sharder(self.task, cfg.micro_batch_size, cfg.global_micro_batches)
        self.source = make_source(self.client, welcome, self.layout, cfg, self.device,
                                  self.tracer)
        self.executor = Executor(
            self.model, self.layout, self.source, sharder, device=self.device,
            micro_batches=cfg.my_micro_batches(), steps=cfg.steps, dropout=self.model.dropout,
            seed=self.mcfg.seed, stash=cfg.stash, tracer=self.tracer, layer_drop=cfg.layer_drop,
            cuda_delays=parse_delays(cfg.cuda_delay),
            budget=GraphBudget(cfg.activation_budget_gib, self.device, cfg.device_memory_gib,
                               sum(worker_device(cfg.device, r) == self.device
                                   for r in range(cfg.world_size))),
            fault=None if welcome.rejoined else Fault.parse(cfg.fault, cfg.rank))
        self.eval_batches = self.evalset.batches() if self.evalset is not None else []

    def train(self) -> None:
        """The steps from where the job stands, each reported; evaluations when due (not
        counted in the training time)."""
        cfg, welcome = self.cfg, self.welcome
        t_start = time.perf_counter()
        samples, seconds = 0, 0.0  # of this worker's steps
        if self.evalset is not None and self._evaluates_first():
            self.evaluate(welcome.step)  # before training (on resume: where it stands)
        for step in range(welcome.step, cfg.steps):
            r = self.executor.run_step(step, frozenset(welcome.pushed) if step == welcome.step
                                       else frozenset())
            self.executor.point(step, "P")
            self.results.append(r)
            samples, seconds = samples + r.samples, seconds + r.seconds
            try:
                self.client.report(report(r, samples, seconds, self.memory))
            except ValueError as e:  # a figure out of range: the report is skipped, not the step
                log.debug("no report for step %d: %s", r.step, e)
            self.events.emit(StepDone(rank=cfg.rank, step=r.step, loss=r.loss,
                                      correct=r.correct, count=r.count, samples=r.samples,
                                      seconds=r.seconds, fetch_wait=round(r.fetch_wait, 6),
                                      push_wait=round(r.push_wait, 6)))
            self.executor.point(step, "E")
            every = self.args.data.eval_every
            if self.evalset is not None and (step + 1 == cfg.steps or every and (step + 1)
                                             % every == 0):
                self.evaluate(step + 1)
        self.elapsed = time.perf_counter() - t_start - self.eval_seconds
        self.peak = self.memory.value()

    def _evaluates_first(self) -> bool:
        """Every worker evaluates where the job starts (or resumes). A replacement redoes the
        evaluation its predecessor may have died in: one due where it resumes, if nothing of
        that step was pushed (which comes after it); a part sent twice counts once."""
        w, every = self.welcome, self.args.data.eval_every
        return not w.rejoined or not w.pushed and (
            w.step in (0, self.cfg.steps) or bool(every) and w.step % every == 0)

    def evaluate(self, version: int) -> None:
        t0 = time.perf_counter()
        loss, correct, count = self.executor.evaluate(
            version, self.eval_batches, prefetch_after=version < self.cfg.steps)
        self.evals.append({"step": version, "loss_sum": loss, "correct": correct,
                           "count": count})
        self.events.emit(EvalDone(rank=self.cfg.rank, step=version, loss_sum=loss,
                                  correct=correct, count=count, objective=self.model.objective))
        self.eval_seconds += time.perf_counter() - t0

    def save(self) -> None:
        """Rank 0 writes --save (atomically: a failed write leaves no partial model). Where the
        OS refuses (a full disk), training is complete all the same: the Bye says done, so the
        EPS finishes and writes its final checkpoint (--server-save), and this worker fails
        with one line that says so."""
        cfg = self.cfg
        if cfg.save and cfg.rank == 0:
            try:
                save_model(self.client, self.source.regions, self.model, self.layout,
                           cfg.steps, cfg.save, {"format": "pt", "steps": str(cfg.steps),
                                                 "model_config": json.dumps(asdict(self.mcfg))})
            except OSError as e:
                self.done = True
                raise ModelNotSaved(
                    f"could not write the model to {cfg.save}: {e.strerror or e}; training is "
                    "complete: with --server-save the EPS's final checkpoint holds it "
                    "(l2l-export writes the model from there)") from None
            log.info("rank 0: model saved to %s", cfg.save)

    def leave(self) -> None:
        """Bye (the EPS drops this worker's waiting Fetches), and everything closed, whatever
        happened: the client first, failing what is still pending, so helper threads end."""
        if self.memory is not None:
            self.memory.close()
        if self.welcome is not None:
            self.client.bye(self.cfg.rank, done=self.done)
        self.client.close()
        for part in (self.source, self.tracer, self.events):
            if part is not None:
                part.close()

    def summary(self) -> dict:
        cfg, results, budget = self.cfg, self.results, self.executor.budget
        samples = sum(r.samples for r in results)
        summary = {
            "rank": cfg.rank, "world_size": cfg.world_size, "device": str(self.device),
            "pid": os.getpid(), "first_step": results[0].step if results else cfg.steps,
            "steps": len(results), "losses": [r.mean_loss for r in results],
            "correct": [r.correct for r in results], "counts": [r.count for r in results],
            "step_seconds": [r.seconds for r in results], "samples": samples,
            "seconds": self.elapsed,
            "samples_per_sec": samples / self.elapsed if self.elapsed > 0 else 0.0,
            "peak_memory_bytes": self.peak, "model": asdict(self.mcfg),
            "data": asdict(self.args.data), "objective": self.model.objective,
            "fetches_without_round_trip": self.source.fast_fetches, "evals": self.evals,
            "activation_budget_bytes": budget.bytes,
            "kept_blocks": budget.most,  # the most a step kept, the last block included
            "kept_block_bytes": budget.per_block,
            "pinned_regions": self.source.regions.registered,
            "unpinned_regions": self.source.regions.refused,
            "config": {k: v for k, v in asdict(cfg).items() if k != "endpoint"},
        }
        if self.summary_path:
            with open(self.summary_path, "w") as f:
                json.dump(summary, f, indent=1)
        return summary


def run_worker(args: WorkerArgs) -> dict:
    """Train; returns this worker's summary (also written to --summary-json)."""
    return WorkerJob(args).run()
