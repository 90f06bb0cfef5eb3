"""Flood: a local peer sends large Hellos (a manifest of ~1.3 MB each, bursts of ``--hellos``,
each burst once the last one was answered) to the EPS of a running 2-worker job, from step
``--flood-from`` to step ``--flood-to``. Reports the job's median step time before the flood and
during it (the same job, the same run), their ratio (target <= 1.5), and the round trip of an
observer's Status before and during the flood (the EPS's loop stays responsive).

Two floods, each in a job of its own: ``same`` sends one manifest again and again; ``distinct``
changes a value in the manifest of every Hello (no two are alike, so nothing the EPS remembers
of one spares it the next).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time

import zmq

from protocol import codec
from protocol.messages import ANY_RANK, PROTOCOL_VERSION, Hello
from protocol.tensors import LayerSpec, Manifest, TensorSpec
from worker.eps_client import EpsClient, EpsDisconnected

from .common import check, l2l_job, median, table

NONCE = b"0" * 16  # the manifest's meta value a distinct flood changes in every Hello


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the baseline")
    p.add_argument("--flood-from", type=int, default=10, help="the flood starts at this step")
    p.add_argument("--flood-to", type=int, default=22, help="... and stops at this one")
    p.add_argument("--hellos", type=int, default=8, help="Hellos per burst")
    p.add_argument("--manifest-kib", type=int, default=1300, help="size of each Hello's body")
    p.add_argument("--floods", default="same,distinct", help="which floods to run")


def hostile_manifest(nbytes: int, tensors: int = 16) -> Manifest:
    """A manifest (not the job's) whose Hello body is about ``nbytes``."""

    def make(layers: int) -> Manifest:
        return Manifest(layers=tuple(LayerSpec(name=f"flood.{i}", kind="block", tensors=tuple(
            TensorSpec(name=f"blocks.{i}.mlp.proj_{j}.weight", shape=(128, 128),
                       group="decay" if j % 2 else "no_decay") for j in range(tensors)))
            for i in range(layers)), meta={"flood": NONCE.decode()})

    per_layer = len(codec.encode(Hello(req_id=1, protocol_version=PROTOCOL_VERSION,
                                       manifest=make(2)))[1]) / 2
    return make(max(1, round(nbytes / per_layer)))


class Flooder:
    """Hellos from one DEALER socket: the same body each time, or one with a new nonce."""

    def __init__(self, endpoint: str, manifest: Manifest, world_size: int, distinct: bool):
        hello = Hello(req_id=1, protocol_version=PROTOCOL_VERSION, rank=ANY_RANK,
                      world_size=world_size, manifest_hash=manifest.hash(), manifest=manifest,
                      pid=os.getpid(), host="flood")
        self.kind, body = codec.encode(hello)
        self.body, self.at = bytearray(body), bytes(body).index(NONCE)
        self.distinct, self.count, self.answers = distinct, 0, {}
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, n: int) -> None:
        for _ in range(n):
            self.count += 1
            if self.distinct:
                self.body[self.at:self.at + len(NONCE)] = b"%016d" % self.count
            self.sock.send_multipart([self.kind, bytes(self.body)], copy=False)

    def take(self, n: int, done: threading.Event, idle, timeout: float = 120.0) -> None:
        """Take ``n`` replies (errors: counted by code), calling ``idle()`` first and every
        0.1 s without one; stop when the job is ``done``."""
        deadline = time.monotonic() + timeout
        idle()
        for _ in range(n):
            while not self.sock.poll(100):
                if done.is_set():
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError("the EPS did not answer the flood's Hellos")
                idle()
            reply, _ = codec.decode(self.sock.recv_multipart())
            code = getattr(reply, "code", type(reply).__name__)
            self.answers[code] = self.answers.get(code, 0) + 1

    def close(self) -> None:
        self.sock.close()


class Probe:
    """An observer's Status requests: the job's step, and how long the EPS took to answer."""

    def __init__(self, endpoint: str):
        self.client = EpsClient(endpoint, timeout=120)
        self.client.observe()
        self.step = 0

    def __call__(self, times: list) -> None:
        t0 = time.perf_counter()
        try:
            self.step = self.client.status().step
        except EpsDisconnected:  # the job ended
            return
        times.append(time.perf_counter() - t0)


def _drive(endpoint: str, a, distinct: bool, manifest: Manifest, done: threading.Event) -> dict:
    """Watch the job's steps; flood between --flood-from and --flood-to."""
    path = endpoint[len("ipc://"):]
    while not os.path.exists(path):
        if done.wait(0.05):
            raise RuntimeError("the job ended before its EPS listened")
    probe, flooder = Probe(endpoint), Flooder(endpoint, manifest, a.workers, distinct)
    quiet, loud = [], []
    try:
        while probe.step < a.flood_from and not done.is_set():
            probe(quiet if probe.step >= a.warmup else [])
            time.sleep(0.05)
        start, t0 = probe.step, time.perf_counter()
        while probe.step < a.flood_to and not done.is_set():
            flooder.send(a.hellos)
            flooder.take(a.hellos, done, lambda: probe(loud))  # Status behind the burst
        return {"start": start, "stop": a.steps if done.is_set() else probe.step,
                "seconds": time.perf_counter() - t0, "hellos": flooder.count,
                "answers": flooder.answers, "status_quiet_ms": median(quiet) * 1e3,
                "status_flood_ms": median(loud) * 1e3,
                "status_flood_max_ms": max(loud, default=float("nan")) * 1e3}
    finally:
        flooder.close()
        probe.client.close()


def _job(a, distinct: bool, manifest: Manifest) -> dict:
    folder = tempfile.mkdtemp(prefix="l2l-flood-")  # 0700: clients accept the socket
    endpoint = f"ipc://{folder}/eps.sock"
    argv = ["--device", "cpu", "--model", "gpt", "--layers", str(a.layers), "--hidden",
            str(a.hidden), "--heads", "4", "--seq-len", "64", "--micro-batches", "2",
            "--micro-batch-size", "8", "--seed", "5", "--lr", "3e-3"]
    done, out = threading.Event(), {}

    def run() -> None:
        try:
            out["summary"] = l2l_job(argv, workers=a.workers, steps=a.steps,
                                     extra=["--endpoint", endpoint], timeout=900)
        except BaseException as e:
            out["error"] = e
        finally:
            done.set()

    job = threading.Thread(target=run, name="l2l-job")
    job.start()
    try:
        flood = _drive(endpoint, a, distinct, manifest, done)
    finally:
        job.join()
        shutil.rmtree(folder, ignore_errors=True)
    if "error" in out:
        raise out["error"]
    # A worker's step k: the slowest worker's time for it; whole steps inside the flood only.
    steps = [max(ts) for ts in zip(*(w["step_seconds"] for w in out["summary"]["workers"]))]
    before = steps[a.warmup:flood["start"]]
    during = steps[flood["start"] + 1:flood["stop"]]
    return {"flood": "distinct" if distinct else "same", **flood,
            "before_s": median(before), "during_s": median(during),
            "ratio": median(during) / median(before), "steps_during": len(during)}


def flood(a) -> dict:
    manifest = hostile_manifest(a.manifest_kib << 10)
    size = len(codec.encode(Hello(req_id=1, protocol_version=PROTOCOL_VERSION,
                                  manifest=manifest))[1])
    runs = [_job(a, kind == "distinct", manifest) for kind in a.floods.split(",")]
    rows = [[r["flood"], r["before_s"], r["during_s"], r["ratio"], r["hellos"],
             r["hellos"] / r["seconds"], r["status_quiet_ms"], r["status_flood_ms"],
             r["status_flood_max_ms"]] for r in runs]
    targets = [check(f"{r['flood']} flood: step time during / before", r["ratio"], "<=", 1.5)
               for r in runs]
    return {
        "table": table(f"flood: {a.workers} workers, gpt L={a.layers} H={a.hidden}; Hellos of "
                       f"{size / 1e6:.2f} MB ({len(manifest.layers)} layers), bursts of "
                       f"{a.hellos} ({os.cpu_count()} cpus)",
                       ["flood", "s/step before", "s/step during", "ratio", "hellos",
                        "hellos/s", "status ms quiet", "status ms flood", "max"], rows),
        "runs": runs, "targets": targets, "hello_bytes": size,
    }
