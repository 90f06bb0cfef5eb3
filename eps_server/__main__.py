"""eps-server: the standalone Eager Param-Server process.

    eps-server --world-size 2 --lr 1e-3 [--endpoint ipc:///tmp/l2l-$UID/eps.sock]

Prints one line ``EPS_READY endpoint=... run_id=... pid=...`` on stdout once it accepts
workers; logs go to stderr. SIGTERM/SIGINT stop it cleanly (shared memory unlinked, final
checkpoint written when --save is given and no step is half done).
"""

from __future__ import annotations

import argparse
import logging
import sys

import uvloop

from protocol.lifecycle import die_with_parent

from .config import OPTIMIZERS, PRECISIONS, OptimizerConfig, ServerConfig
from .server import EpsServer


def add_optimizer_args(p: argparse.ArgumentParser) -> None:
    d = OptimizerConfig()
    g = p.add_argument_group("optimizer (run by the EPS)")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default=d.name)
    g.add_argument("--lr", type=float, default=d.lr)
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--beta1", type=float, default=d.beta1)
    g.add_argument("--beta2", type=float, default=d.beta2)
    g.add_argument("--adam-eps", type=float, default=d.eps)
    g.add_argument("--momentum", type=float, default=d.momentum)


def optimizer_config(a: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(name=a.optimizer, lr=a.lr, weight_decay=a.weight_decay,
                           beta1=a.beta1, beta2=a.beta2, eps=a.adam_eps, momentum=a.momentum)


def parser() -> argparse.ArgumentParser:
    d = ServerConfig()
    p = argparse.ArgumentParser(prog="eps-server", description=__doc__.split("\n")[1],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--endpoint", default=d.endpoint)
    p.add_argument("--world-size", type=int, default=d.world_size,
                   help="workers that contribute to each step")
    p.add_argument("--precision", choices=sorted(PRECISIONS), default=d.precision)
    p.add_argument("--server-threads", type=int, default=d.threads,
                   help="threads for reduction and optimizer updates")
    p.add_argument("--grad-slots", type=int, default=d.grad_slots)
    p.add_argument("--run-id", default="", help="names the shared-memory regions")
    p.add_argument("--load", default="", help="checkpoint directory to resume from")
    p.add_argument("--server-save", default="", dest="save",
                   help="checkpoint directory written at exit")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--exit-when-done", action="store_true",
                   help="exit once every worker has finished")
    p.add_argument("--trace", default="", help="write a Chrome/Perfetto trace here at exit")
    p.add_argument("--log-level", default="INFO")
    add_optimizer_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    die_with_parent()
    logging.basicConfig(level=a.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s eps-server %(levelname)s %(message)s")
    try:
        cfg = ServerConfig(endpoint=a.endpoint, world_size=a.world_size, precision=a.precision,
                           optimizer=optimizer_config(a), threads=a.server_threads,
                           grad_slots=a.grad_slots, run_id=a.run_id, load=a.load, save=a.save,
                           checkpoint_every=a.checkpoint_every, exit_when_done=a.exit_when_done,
                           trace=a.trace)
    except ValueError as e:
        print(f"eps-server: {e}", file=sys.stderr)
        return 2
    server = EpsServer(cfg)
    try:
        uvloop.run(server.serve())
    except (ValueError, FileNotFoundError) as e:
        logging.getLogger("eps_server").error("%s", e)
        return 2
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
