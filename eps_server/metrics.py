"""Prometheus metrics of a running EPS (``--metrics-port``), read when scraped.

Nothing is formatted, locked or written for them on the request path: the EPS bumps plain
integers (stats.py, and one histogram per update) on its event loop whether or not metrics
are on, and a collector reads those and the core's state when scraped, from the HTTP
server's thread. Names follow Prometheus
conventions (``l2l_eps_``, ``_total`` for counters, ``_seconds`` / ``_bytes`` units). The
workers' own figures (``l2l_worker_*``, labelled by rank) come with their heartbeats, so one
endpoint shows the whole job.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from protocol.endpoints import is_loopback_host

from .stats import EpsStats

log = logging.getLogger("eps_server")

COUNTERS = {  # EpsStats field -> (metric name, help)
    "messages": ("messages", "Messages received."),
    "bad_messages": ("bad_messages", "Messages that did not decode."),
    "fetches": ("fetches", "Layers served (LayerReady replies)."),
    "pushes": ("pushes", "Gradients accepted and reduced."),
    "updates": ("updates", "Layer updates (version advances, skipped ones included)."),
    "steps_completed": ("steps_completed", "Steps every layer completed since the start."),
    "overflow_steps": ("overflow_steps", "Steps with a non-finite gradient (fp16) or norm."),
    "skipped_updates": ("skipped_updates", "Layer updates skipped for an overflow."),
    "replies_dropped": ("replies_dropped", "Replies that could not be sent."),
    "busy_refusals": ("busy_refusals", "Requests refused: too many waiting on a connection."),
    "reduce_seconds": ("reduce_seconds", "Engine time spent reading pushed gradients "
                       "(finiteness, norm) before their update."),
    "clipped_steps": ("clipped_steps", "Steps whose global gradient norm was clipped."),
    "rollbacks": ("rollbacks", "Speculative layer updates taken back (clipping, overflow)."),
    "rollback_seconds": ("rollback_seconds", "Engine time spent on rollbacks and redos."),
    "checkpoints_written": ("checkpoints_written", "Checkpoints written."),
    "checkpoint_failures": ("checkpoint_failures", "Checkpoints that could not be written "
                            "(the previous one stands): alert on any."),
}
# WorkerReport field -> (metric name, help): each worker's latest report (its heartbeats).
WORKER_GAUGES = {
    "steps": ("steps", "Steps the worker has finished."),
    "loss": ("loss", "Mean loss of the worker's micro-batches in its last step."),
    "step_seconds": ("step_seconds", "Wall time of the worker's last step."),
    "fetch_wait": ("fetch_wait_seconds", "Time of its last step spent waiting for weights."),
    "push_wait": ("push_wait_seconds", "Time of its last step spent waiting for gradient "
                  "slots or push acks."),
    "samples_per_sec": ("samples_per_second", "The worker's throughput over its steps."),
    "memory": ("memory_bytes", "Device memory the worker uses now (CPU: private RSS)."),
    "peak_memory": ("peak_memory_bytes", "The most device memory the worker has used."),
}


class EpsCollector:
    """Yields the metric families from ``stats`` and ``core()`` (None before the model)."""

    def __init__(self, stats: EpsStats, core: Callable[[], object]):
        self.stats, self.core = stats, core

    def collect(self):
        s = self.stats
        for field, (name, doc) in COUNTERS.items():
            yield CounterMetricFamily(f"l2l_eps_{name}", doc, value=getattr(s, field))
        for what, doc in (("served", "Layer bytes sent to workers"),
                          ("received", "Gradient bytes accepted from workers")):
            c = CounterMetricFamily(f"l2l_eps_bytes_{what}", f"{doc}, by transport.",
                                    labels=["transport"])
            for transport in ("shm", "frames"):
                c.add_metric([transport], getattr(s, f"bytes_{what}_{transport}"))
            yield c
        errors = CounterMetricFamily("l2l_eps_errors", "Error replies, by code.",
                                     labels=["code"])
        for code, n in sorted(s.errors.items()):
            errors.add_metric([code], n)
        yield errors
        h = s.update_latency
        cumulative, buckets = 0, []
        for bound, n in zip([*map(str, h.bounds), "+Inf"], h.counts):
            cumulative += n
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily("l2l_eps_update_seconds", "Time of one layer update on "
                                    "its engine.", buckets=buckets, sum_value=h.sum)
        yield GaugeMetricFamily("l2l_eps_last_checkpoint_step", "Step of the last checkpoint "
                                "written (-1: none).", value=s.last_checkpoint_step)
        yield GaugeMetricFamily("l2l_eps_reducing", "Gradients accepted and not acknowledged "
                                "yet (all workers): held until their layer's update has read "
                                "them.", value=s.reducing)
        core = self.core()
        if core is None:
            return
        versions = core.store.versions
        yield GaugeMetricFamily("l2l_eps_step", "Steps completed by every layer (the lowest "
                                "layer version).", value=max(0, min(versions)))
        yield GaugeMetricFamily("l2l_eps_layers_ahead", "Layers already at the next version "
                                "(eager updates under way).",
                                value=sum(v > min(versions) for v in versions))
        yield GaugeMetricFamily("l2l_eps_learning_rate", "Learning rate of the current step.",
                                value=core.cfg.optimizer.lr_at(max(0, min(versions))))
        yield GaugeMetricFamily("l2l_eps_loss_scale", "fp16 dynamic loss scale (1 otherwise).",
                                value=core.scheduler.scaler.scale)
        peers = core.peers.snapshot()
        yield GaugeMetricFamily("l2l_eps_workers_connected", "Workers registered and alive.",
                                value=sum(1 for p in peers if p.worker))
        age = GaugeMetricFamily("l2l_eps_heartbeat_age_seconds", "Seconds since each worker "
                                "was last heard from.", labels=["rank"])
        now = core.peers.clock()
        for p in peers:
            if p.worker:
                age.add_metric([str(p.rank)], max(0.0, now - p.last_seen))
        yield age
        yield from worker_metrics([p for p in peers if p.worker and p.report is not None])


def worker_metrics(peers):
    """``l2l_worker_*`` gauges, one sample per rank, from the workers' latest reports."""
    reports = [(str(p.rank), p.report) for p in peers]
    for field, (name, doc) in WORKER_GAUGES.items():
        g = GaugeMetricFamily(f"l2l_worker_{name}", doc, labels=["rank"])
        for rank, r in reports:
            g.add_metric([rank], getattr(r, field))
        yield g
    compute = GaugeMetricFamily("l2l_worker_compute_seconds", "Time of its last step not "
                                "spent waiting for the EPS.", labels=["rank"])
    for rank, r in reports:
        compute.add_metric([rank], max(0.0, r.step_seconds - r.fetch_wait - r.push_wait))
    yield compute


def serve(port: int, host: str, insecure: bool, stats: EpsStats, core: Callable[[], object]):
    """Start the HTTP endpoint on its own thread; returns the server (``shutdown()`` it)."""
    if not is_loopback_host(host) and not insecure:
        raise ValueError(f"refusing to serve metrics on {host}: a non-loopback address "
                         "exposes the run to anyone who can reach it (use --insecure)")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EpsCollector(stats, core))
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:  # said as the metrics port's, not as a bare "Address already in use"
        raise OSError(e.errno, f"metrics endpoint {host}:{port} (--metrics-port): "
                               f"{e.strerror}") from None
    log.info("metrics on http://%s:%d/metrics", host, server.server_port)
    return server
