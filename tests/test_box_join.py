"""The boxes' rendezvous when a restarted job meets the last run's: real processes, a real
torch.distributed TCP store and gloo group on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from .helpers import ENV, free_port

# The last run's box 0 as it exits: its store holds the port (with its keys) until told.
OLD_STORE = """
import datetime, sys
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, True,
                      timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
store.set("stale", "x")
print("up", flush=True)
sys.stdin.readline()
"""

BOX = """
import logging, sys
import torch, torch.distributed as dist
from eps_server.boxes import CrossBox
from eps_server.config import BoxesConfig
logging.basicConfig(level=logging.INFO)
CrossBox.join(BoxesConfig(nodes=2, node_rank=int(sys.argv[1]), master_port=int(sys.argv[2]),
                          box_timeout=30))
t = torch.ones(1)
dist.all_reduce(t)
print("joined", t.item(), flush=True)
"""


def test_boxes_join_once_the_last_runs_store_has_gone(tmp_path):
    """Box 0 finds the port held (and box 1, started with it, the old store); once the old
    store has gone both join one group, whose all-reduce sums both boxes: a failed try is
    made again (each would have cost the job a restart)."""
    port = free_port()
    procs = []

    def start(code: str, *args, log=None) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=ENV,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             stderr=log or subprocess.DEVNULL, start_new_session=True)
        procs.append(p)
        return p

    try:
        old = start(OLD_STORE, port)
        assert old.stdout.readline().strip() == "up"
        logs = [tmp_path / f"box{rank}.log" for rank in (0, 1)]
        boxes = [start(BOX, rank, port, log=logs[rank].open("w")) for rank in (0, 1)]
        for _ in range(600):  # until box 0 has met the port held
            if "box 0: joining failed, trying again" in logs[0].read_text():
                break
            assert boxes[0].poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.1)
        else:
            raise AssertionError(f"box 0 never met the old store: {logs[0].read_text()}")
        old.communicate("\n", timeout=30)  # the last run's box 0 exits
        for rank, b in enumerate(boxes):
            out, _ = b.communicate(timeout=90)
            assert b.returncode == 0 and "joined 2.0" in out, logs[rank].read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
