"""Layer transfer: through the EPS's shared memory vs a raw ``copy_`` of the same bytes, and
through ZeroMQ frames vs raw pyzmq request/reply of the same bytes, side by side.

The EPS side is a real eps-server process; the layers are BERT-Large sized by default
(12.6M fp32 parameters, 50 MB). A worker's layer fetch is "version board + copy": the version is
already published (the Fetch for it was answered one visit ahead, or the shared board shows
it), then one copy out of shared memory (on CUDA: into the device). A CPU worker skips the copy
and reads shared memory in place. "Fetch round trip + copy" is the same with a synchronous
request first.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import subprocess
import sys
import tempfile
import time

import torch
import zmq

from protocol.tensors import LayerSpec, Manifest, TensorSpec, plan_layout
from worker.eps_client import EpsClient
from worker.transfer import Regions, layer_view

from .common import ENV, check, median, table


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--numel", type=int, default=12_582_912, help="elements per layer")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=20)


def _manifest(layers: int, numel: int) -> Manifest:
    return Manifest(layers=tuple(LayerSpec(name=f"l{i}", kind="k", tensors=(
        TensorSpec(name="w", shape=(numel,)),)) for i in range(layers)), meta={"bench": 1})


def _server(endpoint: str):
    p = subprocess.Popen([sys.executable, "-m", "eps_server", "--endpoint", endpoint,
                          "--run-id", "b" + secrets.token_hex(4), "--log-level", "WARNING"],
                         env=ENV, stdout=subprocess.PIPE, text=True)
    assert "EPS_READY" in p.stdout.readline()
    return p


def _eps_times(endpoint: str, transport: str, a) -> dict:
    manifest = _manifest(a.layers, a.numel)
    layout = plan_layout(manifest)
    client = EpsClient(endpoint, timeout=120)
    regions = Regions(pin=False)
    try:
        welcome = client.hello(rank=0, world_size=1, manifest=manifest, transport=transport,
                               grad_dtype="float32")
        for layer in welcome.init_layers:
            client.wait(client.init_layer(layer, torch.randn(layout.layers[layer].numel)
                                          .numpy().data))
        board = None
        if transport == "shm":
            regions.attach(welcome.master, writable=False)
            board = regions.attach(welcome.versions, writable=False).tensor(torch.int64)
        dst = torch.empty(layout.max_layer_numel)
        fetch_only, fetch_copy, board_copy = [], [], []
        warmup = a.layers  # one round over every layer first: page faults of the first touch
        for rep in range(warmup + a.reps):
            layer = rep % a.layers
            plan = layout.layers[layer]
            t0 = time.perf_counter()
            ready, frames = client.wait(client.fetch(layer, 0))
            t1 = time.perf_counter()
            dst[:plan.numel].copy_(layer_view(regions, plan, ready, frames))
            t2 = time.perf_counter()
            if board is not None:  # the worker's path: version already published, no request
                t3 = time.perf_counter()
                assert int(board[layer]) >= 0
                dst[:plan.numel].copy_(layer_view(regions, plan, ready, frames))
                if rep >= warmup:
                    board_copy.append(time.perf_counter() - t3)
            if rep >= warmup:
                fetch_only.append(t1 - t0)
                fetch_copy.append(t2 - t0)
        return {"fetch_only": median(fetch_only), "fetch_copy": median(fetch_copy),
                "board_copy": median(board_copy)}
    finally:
        regions.close()
        client.close()


def _raw_copy(a) -> float:
    srcs = [torch.randn(a.numel) for _ in range(a.layers)]  # same rotation as the fetches
    dst = torch.empty(a.numel)
    times = []
    for rep in range(a.layers + a.reps):
        t0 = time.perf_counter()
        dst.copy_(srcs[rep % a.layers])
        if rep >= a.layers:
            times.append(time.perf_counter() - t0)
    return median(times)


def _raw_zmq_server(endpoint: str, nbytes: int) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.bind(endpoint)
    payload = torch.randn(nbytes // 4).numpy().data
    while True:
        ident, msg = s.recv_multipart()
        if msg == b"stop":
            break
        s.send_multipart([ident, b"x", payload], copy=False)
    s.close()
    ctx.term()


def _raw_zmq(endpoint: str, a) -> float:
    proc = mp.get_context("spawn").Process(target=_raw_zmq_server,
                                           args=(endpoint, a.numel * 4), daemon=True)
    proc.start()
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(endpoint)
    times = []
    try:
        for rep in range(a.reps + 2):
            t0 = time.perf_counter()
            s.send(b"get")
            s.recv_multipart(copy=False)
            if rep >= 2:
                times.append(time.perf_counter() - t0)
        s.send(b"stop")
    finally:
        s.close(linger=1000)
        ctx.term()
        proc.join(10)
    return median(times)


def transfer(a) -> dict:
    torch.set_num_threads(1)  # a worker's copy thread; the raw copy gets the same
    nbytes = a.numel * 4
    with tempfile.TemporaryDirectory(prefix="l2l-t-") as tmp:
        results = {}
        for transport in ("shm", "frames"):
            endpoint = f"ipc://{tmp}/{transport}.sock"
            server = _server(endpoint)
            try:
                results[transport] = _eps_times(endpoint, transport, a)
            finally:
                server.terminate()
                server.wait(30)
        raw_copy = _raw_copy(a)
        raw_zmq = _raw_zmq(f"ipc://{tmp}/raw.sock", a)
    gbs = lambda t: nbytes / t / 1e9  # noqa: E731
    shm, frames = results["shm"], results["frames"]
    rows = [["raw copy_ (private -> private)", raw_copy, gbs(raw_copy), 1.0],
            ["EPS shm: version board + copy (worker)", shm["board_copy"],
             gbs(shm["board_copy"]), raw_copy / shm["board_copy"]],
            ["EPS shm: Fetch round trip + copy", shm["fetch_copy"], gbs(shm["fetch_copy"]),
             raw_copy / shm["fetch_copy"]],
            ["EPS shm: Fetch round trip only", shm["fetch_only"], None, None],
            ["raw pyzmq request -> frame reply", raw_zmq, gbs(raw_zmq), 1.0],
            ["EPS frames: fetch", frames["fetch_only"], gbs(frames["fetch_only"]),
             raw_zmq / frames["fetch_only"]]]
    rows = [[r[0], r[1], "-" if r[2] is None else r[2], "-" if r[3] is None else r[3]]
            for r in rows]
    return {
        "table": table(f"transfer: one layer of {nbytes / 2**20:.0f} MiB fp32 ({os.cpu_count()} "
                       "cpus)", ["path", "seconds", "GB/s", "vs raw"], rows),
        "seconds": {"raw_copy": raw_copy, "shm_board_copy": shm["board_copy"],
                    "shm_fetch_copy": shm["fetch_copy"],
                    "shm_fetch_only": shm["fetch_only"], "raw_zmq": raw_zmq,
                    "frames_fetch": frames["fetch_only"]},
        "ratios": {"shm_vs_raw_copy": raw_copy / shm["board_copy"],
                   "shm_with_round_trip_vs_raw_copy": raw_copy / shm["fetch_copy"],
                   "frames_vs_raw_zmq": raw_zmq / frames["fetch_only"]},
        "targets": [check("shm layer fetch / raw copy", raw_copy / shm["board_copy"], ">=", 0.7),
                    check("frames fetch / raw pyzmq", raw_zmq / frames["fetch_only"], ">=", 0.7)],
    }
