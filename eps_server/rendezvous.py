"""The boxes' rendezvous (``--nodes N``): every box's EPS joins one torch.distributed gloo group.

``tcp``: box 0 serves a TCP store on master_port and every box connects. A restarted job may
meet the last run's store while that run's box 0 exits: box 0 then finds its port held, and
box 1 reaches the old store, whose keys (the old group's addresses) would join it to a dead
run. So each box first claims its rank in the store with a token of its own (compare-and-set):
a store in which the rank is claimed already is a previous run's. Such a store, a held port or
a store that closes is tried again every second within ``box_timeout``; an error no retry can
cure (a bad address) fails at once.

``env`` (torchrun): one try, in torchrun's agent store; torchrun restarts on its own.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import os
import secrets
import socket
import time

from protocol.endpoints import is_loopback_host

from .boxes import BoxLost
from .config import BoxesConfig

log = logging.getLogger("eps_server")


# Box 0's store, kept for the process's life: a retry (the group failed to form) must use it
# again, not bind its port a second time.
_served: dict[tuple[str, int], object] = {}


class StaleStore(RuntimeError):
    """The store at master_port is a previous run's."""


def join(cfg: BoxesConfig) -> None:
    """Join the boxes' group (blocks until every box is there); raises BoxLost."""
    import torch.distributed as dist

    if cfg.master_addr in ("127.0.0.1", "localhost", "::1"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the group's pairs on loopback
    log.info("box %d of %d: joining the boxes' group at %s:%d (up to %g s)", cfg.node_rank,
             cfg.nodes, cfg.master_addr, cfg.master_port, cfg.box_timeout)
    deadline = time.monotonic() + cfg.box_timeout
    token = secrets.token_hex(8)  # this box's claim, the same in every try

    def failed(e: BaseException) -> BoxLost:
        return BoxLost(f"box {cfg.node_rank} could not join the {cfg.nodes} boxes at "
                       f"{cfg.master_addr}:{cfg.master_port} within {cfg.box_timeout:g} s: {e}")

    while True:
        timeout = datetime.timedelta(seconds=max(deadline - time.monotonic(), 1))
        try:
            if cfg.rendezvous == "env":
                return dist.init_process_group("gloo", init_method="env://",
                                               rank=cfg.node_rank, world_size=cfg.nodes,
                                               timeout=timeout)
            store = _claimed(cfg, token, timeout)
            return dist.init_process_group("gloo", store=store, rank=cfg.node_rank,
                                           world_size=cfg.nodes, timeout=timeout)
        except (RuntimeError, OSError) as e:  # a held port, a store gone, a stale one
            if dist.is_initialized():
                dist.destroy_process_group()
            dist.distributed_c10d._world.group_count = 0  # the group's name counts the tries
            if cfg.rendezvous == "env" or time.monotonic() + 1 >= deadline:
                raise failed(e) from None
            log.warning("box %d: joining failed, trying again: %s", cfg.node_rank, e)
            time.sleep(1)
        except Exception as e:
            raise failed(e) from None


def _claimed(cfg: BoxesConfig, token: str, timeout: datetime.timedelta):
    """The store at master_port (box 0 serves it), with this box's rank claimed by ``token``;
    raises StaleStore where another token claimed it: a previous run's store."""
    import torch.distributed as dist

    where = (cfg.master_addr, cfg.master_port)
    store = _served.get(where) if cfg.node_rank == 0 else None  # (a retry: box 0's own)
    if store is None:
        listen = _listening(*where) if cfg.node_rank == 0 else None
        try:
            store = dist.TCPStore(cfg.master_addr, cfg.master_port, cfg.nodes,
                                  cfg.node_rank == 0, timeout=timeout, wait_for_workers=False,
                                  multi_tenant=True, master_listen_fd=listen)
        except BaseException:
            if listen is not None:
                with contextlib.suppress(OSError):
                    os.close(listen)
            raise
        if cfg.node_rank == 0:
            _served[where] = store
    key = f"l2l-box-{cfg.node_rank}"
    if store.compare_set(key, "", token) != token.encode():
        raise StaleStore(f"{cfg.master_addr}:{cfg.master_port} serves a previous run's store "
                         f"(box {cfg.node_rank} claimed already)")
    return dist.PrefixStore("default_pg", store)


def _listening(addr: str, port: int) -> int:
    """Box 0's store socket, listening on ``addr`` only (the store's own binds every interface
    whatever its host: anyone who reaches the port could read and forge the group's keys);
    its fd, given to the store. A held port raises OSError (tried again); a name of this
    machine's that resolves to loopback here (/etc/hosts) raises ValueError: the other boxes
    could not reach it."""
    family, kind, proto, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    if not is_loopback_host(addr) and ipaddress.ip_address(where[0]).is_loopback:
        raise ValueError(f"--master-addr {addr} resolves to {where[0]} on box 0 (its hosts "
                         "file), where the other boxes cannot reach its store: give box 0's "
                         "address on the boxes' network")
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock.detach()
