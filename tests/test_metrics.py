"""The EPS's Prometheus endpoint, scraped from outside during a real job."""

from __future__ import annotations

import signal
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from eps_server.config import ServerConfig

from .helpers import SMALL, free_port
from .test_server import raw_socket


def scrape(port: int) -> dict:
    """{(name, labels): value} of every sample."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text.decode()) for s in fam.samples}


def test_a_running_job_is_scraped(cluster):
    port = free_port()
    cluster.start_server(2, "--metrics-port", str(port), "--heartbeat-timeout", "5")
    before = scrape(port)  # no model yet: the counters are there, the model's gauges not
    assert before[("l2l_eps_messages_total", ())] == 0 and ("l2l_eps_step", ()) not in before
    bad = raw_socket(cluster.endpoint)
    bad.send_multipart([b"\xff", b"not a message"])
    assert bad.poll(10_000) and bad.recv_multipart()
    bad.close(0)
    assert scrape(port)[("l2l_eps_errors_total", (("code", "bad_message"),))] == 1
    # A job longer than any test: it is stopped (SIGTERM) once seen, however fast it runs.
    workers = [cluster.worker(r, 2, *SMALL, "--steps", "1000000") for r in range(2)]
    seen = {}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and all(w.poll() is None for w in workers):
        m = scrape(port)
        if m.get(("l2l_eps_workers_connected", ()), 0) == 2 and m[("l2l_eps_step", ())] >= 3 \
                and all(m.get(("l2l_worker_steps", (("rank", r),)), 0) >= 1 for r in "01"):
            seen = m
            break
        time.sleep(0.1)
    assert seen, "never saw both workers and 3 steps"
    L = 4  # embeddings, 2 blocks, head
    assert seen[("l2l_eps_updates_total", ())] >= 3 * L
    assert seen[("l2l_eps_pushes_total", ())] >= 2 * 3 * L
    # Read while training goes on: the histogram is read after the counter.
    assert seen[("l2l_eps_update_seconds_count", ())] >= seen[("l2l_eps_updates_total", ())]
    buckets = [v for (name, labels), v in seen.items() if name == "l2l_eps_update_seconds_bucket"]
    assert buckets == sorted(buckets) and seen[("l2l_eps_update_seconds_sum", ())] > 0
    assert seen[("l2l_eps_bytes_received_total", (("transport", "shm"),))] > 0
    assert seen[("l2l_eps_bytes_received_total", (("transport", "frames"),))] == 0
    for rank in ("0", "1"):
        assert 0 <= seen[("l2l_eps_heartbeat_age_seconds", (("rank", rank),))] < 5
        worker = {name[len("l2l_worker_"):]: v for (name, labels), v in seen.items()
                  if name.startswith("l2l_worker_") and labels == (("rank", rank),)}
        assert worker["steps"] >= 1 and worker["samples_per_second"] > 0
        assert worker["step_seconds"] >= worker["fetch_wait_seconds"] + \
            worker["push_wait_seconds"] + worker["compute_seconds"] - 1e-9
        assert worker["loss"] > 0 and worker["memory_bytes"] > 0 and \
            worker["peak_memory_bytes"] > 0
    assert seen[("l2l_eps_learning_rate", ())] > 0 and seen[("l2l_eps_loss_scale", ())] == 1
    assert seen[("l2l_eps_checkpoint_failures_total", ())] == 0  # no --server-save here
    assert seen[("l2l_eps_last_checkpoint_step", ())] == -1
    for w in workers:
        w.terminate()  # a worker says Bye on SIGTERM
    for w in workers:
        assert cluster.wait(w) == 128 + signal.SIGTERM, cluster.log(w)
    cluster.server.terminate()
    assert cluster.wait(cluster.server, 60) == 0, cluster.log(cluster.server)


def test_metrics_on_a_routable_address_need_insecure():
    with pytest.raises(ValueError, match="--insecure"):
        ServerConfig(metrics_port=9400, metrics_host="0.0.0.0")
    assert ServerConfig(metrics_port=9400, metrics_host="0.0.0.0", insecure=True)


def test_a_busy_metrics_port_is_named_as_the_metrics_port():
    import socket

    from eps_server import metrics
    from eps_server.stats import EpsStats

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"metrics endpoint 127.0.0.1:{port} "
                                          r"\(--metrics-port\): Address already in use"):
            metrics.serve(port, "127.0.0.1", False, EpsStats(), lambda: None)
