"""The boxes' rendezvous when a restarted job meets the last run's: real processes, a real
torch.distributed TCP store and gloo groups on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from .helpers import ENV, free_port

# A box: joins, sums a one across the boxes, says so; box 0 of the last run then stays (as an
# exiting EPS's does, its store holding the port and the old group's keys) until told. It
# leaves the group as the EPS does on its way out (CrossBox.close): a process that exits with
# the group's threads alive may abort (SIGABRT, about 1 exit in 15 here).
BOX = """
import logging, sys
import torch, torch.distributed as dist
from eps_server.boxes import CrossBox
from eps_server.config import BoxesConfig
from eps_server.rendezvous import join
logging.basicConfig(level=logging.INFO)
rank, port, last = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "last"
join(BoxesConfig(nodes=2, node_rank=rank, master_port=port, box_timeout=60))
t = torch.ones(1)
dist.all_reduce(t)
print("joined", t.item(), flush=True)
if last and rank == 0:
    sys.stdin.readline()
CrossBox.close()
"""


def test_a_restarted_job_joins_once_the_last_runs_box_0_has_gone(tmp_path):
    """The last run's boxes joined; its box 1 is gone, its box 0 still holds the port (and
    the store, with the old group's addresses). The new box 0 finds the port held, the new box
    1 finds its rank claimed in the old store: both try again (a failed try cost the job a
    restart; a box that took the old keys would join a dead run). Once the old box 0 has gone
    they join one group, whose all-reduce sums both boxes. The store listens on loopback
    only."""
    port = free_port()
    procs = []

    def start(rank: int, run: str) -> tuple[subprocess.Popen, object]:
        log = tmp_path / f"{run}-box{rank}.log"
        p = subprocess.Popen([sys.executable, "-c", BOX, str(rank), str(port), run], env=ENV,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=log.open("w"), text=True, start_new_session=True)
        procs.append(p)
        return p, log

    def wait_for(what: str, p: subprocess.Popen, log, times: int = 1) -> None:
        for _ in range(900):
            if log.read_text().count(what) >= times:
                return
            assert p.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        raise AssertionError(f"never said {what!r} {times} times: {log.read_text()[-3000:]}")

    try:
        last = [start(rank, "last") for rank in (0, 1)]
        for p, log in last:
            assert p.stdout.readline().strip() == "joined 2.0", log.read_text()[-3000:]
        # box 0's store listens on --master-addr (loopback), not on every interface: anyone
        # who reached it could read and forge the group's keys, and take a box's place
        assert listeners(port) == ["0100007F"], listeners(port)
        assert last[1][0].wait(30) == 0  # the last run's box 1 has exited; its box 0 stays
        new = [start(rank, "new") for rank in (0, 1)]
        wait_for("joining failed, trying again: [Errno 98] Address already in use", *new[0],
                 times=2)
        wait_for("serves a previous run's store (box 1 claimed already)", *new[1], times=2)
        last[0][0].communicate("\n", timeout=30)  # the last run's box 0 exits
        for p, log in new:
            out, _ = p.communicate(timeout=90)
            assert p.returncode == 0 and "joined 2.0" in out, log.read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)



def listeners(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net shows them) listening on ``port``."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and local.endswith(f":{port:04X}"):
                out.append(local.rpartition(":")[0])
    return out


RETRY = """
import sys
import torch.distributed as dist
from eps_server import rendezvous
from eps_server.config import BoxesConfig
calls = []
def fail_then_stop(*a, **kw):
    calls.append(1)
    if len(calls) == 1:
        raise RuntimeError("Connection reset by peer")  # the group failed to form: tried again
    raise KeyboardInterrupt
dist.init_process_group = fail_then_stop
try:
    rendezvous.join(BoxesConfig(nodes=2, node_rank=0, master_port=int(sys.argv[1]),
                                box_timeout=5))
except KeyboardInterrupt:
    print("tried again", len(calls))
"""


def test_box_0_tries_again_with_the_store_it_serves():
    """A try whose group failed to form left box 0's store listening: the next bound the port
    again and found it held, every second, until the timeout."""
    p = subprocess.run([sys.executable, "-c", RETRY, str(free_port())], env=ENV,
                       capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "tried again 2", p.stdout + p.stderr


def test_a_master_addr_that_resolves_to_loopback_on_box_0_is_refused():
    """A hosts file that maps the machine's name to 127.0.x.1 (Debian's default): the store
    listened there, and the other boxes timed out without a word of why."""
    import socket

    import pytest

    from eps_server.rendezvous import _listening

    name = socket.gethostname()
    try:
        address = socket.getaddrinfo(name, 1, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        pytest.skip("this machine's name does not resolve")
    if not address.startswith("127.") or name in ("localhost",):
        pytest.skip(f"{name} resolves to {address} here")
    with pytest.raises(ValueError, match=f"--master-addr {name} resolves to {address} on box "
                       "0 .* the other boxes cannot reach its store"):
        _listening(name, free_port())
