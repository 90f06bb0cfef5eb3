"""Bootstrapping from a Hugging Face checkpoint: the worker's peak private memory while it sends
a checkpoint of L layers to the EPS, for L = 4 and 32 (8x the checkpoint), measured from
outside (this process samples /proc/<worker>/statm: resident minus shared pages, every 2 ms).

The worker reads the checkpoint's tensors as views of the mapped file and assembles each layer
in one of a ring of buffers, a few in flight: its memory should not grow with L (the EPS's
does: it holds the model).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from .common import ENV, check, table

_PAGE = os.sysconf("SC_PAGE_SIZE")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--depths", default="4,32")
    p.add_argument("--hidden", type=int, default=512)


def _checkpoint(path: str, layers: int, hidden: int) -> int:
    """A GPT-2 directory of ``layers`` blocks (random weights); returns its bytes."""
    import transformers as tf

    cfg = tf.GPT2Config(vocab_size=1024, n_embd=hidden, n_layer=layers, n_head=8,
                        n_positions=128)
    tf.GPT2LMHeadModel(cfg).save_pretrained(path)
    return os.path.getsize(os.path.join(path, "model.safetensors"))


def _private(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            fields = f.read().split()
    except OSError:
        return 0
    return (int(fields[1]) - int(fields[2])) * _PAGE


def _bootstrap_peak(model: str, tmp: str) -> int:
    """Peak private memory of a worker that bootstraps ``model`` into a fresh EPS and stops."""
    endpoint = f"ipc://{tmp}/eps.sock"
    events = os.path.join(tmp, "eps.events")
    server = subprocess.Popen([sys.executable, "-m", "eps_server", "--endpoint", endpoint,
                               "--exit-when-done", "--events", events, "--log-level",
                               "WARNING"], env=ENV)
    try:
        from protocol.events import Ready, wait_for

        wait_for(events, Ready, server)
        worker = subprocess.Popen([sys.executable, "-m", "worker", "--endpoint", endpoint,
                                   "--model", f"hf:{model}", "--steps", "0", "--task", "markov",
                                   "--log-level", "WARNING"], env=ENV)
        peak = 0
        while worker.poll() is None:
            peak = max(peak, _private(worker.pid))
            time.sleep(0.002)
        if worker.returncode != 0:
            raise RuntimeError(f"the worker failed ({worker.returncode})")
        server.wait(timeout=120)
        return peak
    finally:
        for p in (server,):
            if p.poll() is None:
                p.kill()
                p.wait()


def bootstrap(a) -> dict:
    depths = [int(d) for d in a.depths.split(",")]
    rows, peaks, sizes = [], {}, {}
    with tempfile.TemporaryDirectory(prefix="l2l-boot-") as tmp:
        for depth in depths:
            path = os.path.join(tmp, f"gpt2-{depth}")
            sizes[depth] = _checkpoint(path, depth, a.hidden)
            peaks[depth] = _bootstrap_peak(path, tmp)
            rows.append([depth, sizes[depth] / 2**20, peaks[depth] / 2**20])
    lo, hi = depths[0], depths[-1]
    ratio = peaks[hi] / peaks[lo]
    rows.append([f"{hi}/{lo}", sizes[hi] / sizes[lo], ratio])
    return {
        "table": table(f"bootstrap: GPT-2 H={a.hidden}, worker peak private memory (MiB)",
                       ["layers", "checkpoint MiB", "worker peak MiB"], rows),
        "peak_bytes": {str(d): v for d, v in peaks.items()},
        "checkpoint_bytes": {str(d): v for d, v in sizes.items()},
        "ratios": {f"peak_{hi}_over_{lo}": ratio},
        "targets": [check(f"worker peak at {hi} / at {lo} layers", ratio, "<=", 1.1)],
    }
