"""Layer transfer: through the EPS's shared memory vs a raw ``copy_`` of the same bytes, and
through ZeroMQ frames vs raw pyzmq request/reply of the same bytes, side by side.

The EPS side is a real eps-server process; the layers are BERT-Large sized by default
(12.6M fp32 parameters, 50 MB). A worker's layer fetch is "version board + copy": the version is
already published (the Fetch for it was answered one visit ahead, or the shared board shows
it), then one copy out of shared memory (on CUDA: into the device). A CPU worker skips the copy
and reads shared memory in place. "Fetch round trip + copy" is the same with a synchronous
request first. All paths are timed in interleaved rounds, so the machine's noise falls on all.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import subprocess
import sys
import tempfile

import torch
import zmq

from protocol.events import Ready, wait_for
from protocol.tensors import LayerSpec, Manifest, TensorSpec, plan_layout
from worker.eps_client import EpsClient
from worker.regions import Regions, layer_view

from .common import ENV, check, interleaved, table


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--numel", type=int, default=12_582_912, help="elements per layer")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=20)


def _manifest(layers: int, numel: int) -> Manifest:
    return Manifest(layers=tuple(LayerSpec(name=f"l{i}", kind="k", tensors=(
        TensorSpec(name="w", shape=(numel,)),)) for i in range(layers)), meta={"bench": 1})


def _server(endpoint: str, events: str, *extra: str):
    p = subprocess.Popen([sys.executable, "-m", "eps_server", "--endpoint", endpoint,
                          "--run-id", "b" + secrets.token_hex(4), "--log-level", "WARNING",
                          "--events", events, *extra], env=ENV)
    wait_for(events, Ready, p)
    return p


class _EpsPeer:
    """A client of a real eps-server whose layers it has initialised."""

    def __init__(self, endpoint: str, transport: str, a):
        manifest = _manifest(a.layers, a.numel)
        self.layout = plan_layout(manifest)
        self.client = EpsClient(endpoint, timeout=120)
        self.regions = Regions(pin=False)
        welcome = self.client.hello(rank=0, world_size=1, manifest=manifest,
                                    transport=transport, grad_dtype="float32")
        for layer in welcome.init_layers:
            self.client.wait(self.client.init_layer(
                layer, torch.randn(self.layout.layers[layer].numel).numpy().data))
        self.master = self.board = None
        if transport == "shm":
            self.master = self.regions.attach(welcome.master, writable=False)
            self.board = self.regions.attach(welcome.versions, writable=False).tensor(torch.int64)

    def fetch(self, layer: int):
        ready, frames = self.client.wait(self.client.fetch(layer, 0))
        return layer_view(self.regions, self.layout.layers[layer], ready, frames)

    def published(self, layer: int) -> torch.Tensor:
        """The worker's path for a version the board shows: no request at all."""
        assert int(self.board[layer]) >= 0
        plan = self.layout.layers[layer]
        return self.master.tensor(torch.float32, plan.offset, plan.numel)

    def close(self) -> None:
        self.regions.close()
        self.client.close()


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


def transfer(a) -> dict:
    torch.set_num_threads(1)  # a worker's copy thread; the raw copy gets the same
    nbytes = a.numel * 4
    dst = torch.empty(a.numel)
    srcs = [torch.randn(a.numel) for _ in range(a.layers)]  # same rotation as the layers
    turn = [0]

    def layer() -> int:
        return turn[0] % a.layers

    with tempfile.TemporaryDirectory(prefix="l2l-t-") as tmp:
        servers = [_server(f"ipc://{tmp}/{t}.sock", f"{tmp}/{t}.events")
                   for t in ("shm", "frames")]
        raw = mp.get_context("spawn").Process(
            target=_raw_zmq_server, args=(f"ipc://{tmp}/raw.sock", nbytes), daemon=True)
        raw.start()
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f"ipc://{tmp}/raw.sock")
        shm = _EpsPeer(f"ipc://{tmp}/shm.sock", "shm", a)
        frames = _EpsPeer(f"ipc://{tmp}/frames.sock", "frames", a)

        def raw_zmq():
            sock.send(b"get")
            sock.recv_multipart(copy=False)

        def next_layer():
            turn[0] += 1

        try:
            t = interleaved({
                "raw_copy": lambda: dst.copy_(srcs[layer()]),
                "shm_board_copy": lambda: dst.copy_(shm.published(layer())),
                "shm_fetch_copy": lambda: dst.copy_(shm.fetch(layer())),
                "shm_fetch_only": lambda: shm.fetch(layer()),
                "raw_zmq": raw_zmq,
                "frames_fetch": lambda: frames.fetch(layer()),
                "next": next_layer,  # untimed in effect: rotates the layer each round
            }, a.reps, warmup=a.layers)  # warm-up: the first touch of every page
        finally:
            sock.send(b"stop")
            sock.close(linger=1000)
            ctx.term()
            raw.join(10)
            for peer in (shm, frames):
                peer.close()
            for server in servers:
                server.terminate()
                server.wait(30)

    def gbs(s: float) -> float:
        return nbytes / s / 1e9

    shm_ratio = t["raw_copy"] / t["shm_board_copy"]
    rtt_ratio = t["raw_copy"] / t["shm_fetch_copy"]
    frames_ratio = t["raw_zmq"] / t["frames_fetch"]
    rows = [["raw copy_ (private -> private)", t["raw_copy"], gbs(t["raw_copy"]), 1.0],
            ["EPS shm: version board + copy (worker)", t["shm_board_copy"],
             gbs(t["shm_board_copy"]), shm_ratio],
            ["EPS shm: Fetch round trip + copy", t["shm_fetch_copy"], gbs(t["shm_fetch_copy"]),
             rtt_ratio],
            ["EPS shm: Fetch round trip only", t["shm_fetch_only"], "-", "-"],
            ["raw pyzmq request -> frame reply", t["raw_zmq"], gbs(t["raw_zmq"]), 1.0],
            ["EPS frames: fetch", t["frames_fetch"], gbs(t["frames_fetch"]), frames_ratio]]
    return {
        "table": table(f"transfer: one layer of {nbytes / 2**20:.0f} MiB fp32 ({os.cpu_count()} "
                       "cpus)", ["path", "seconds", "GB/s", "vs raw"], rows),
        "seconds": {k: v for k, v in t.items() if k != "next"},
        "ratios": {"shm_vs_raw_copy": shm_ratio, "shm_with_round_trip_vs_raw_copy": rtt_ratio,
                   "frames_vs_raw_zmq": frames_ratio},
        "targets": [check("shm layer fetch / raw copy", shm_ratio, ">=", 0.7),
                    check("frames fetch / raw pyzmq", frames_ratio, ">=", 0.7)],
    }
