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

from .config import OPTIMIZERS, PRECISIONS, UPDATES, OptimizerConfig, ServerConfig
from .schedules import SCHEDULES
from .server import EpsServer

# (flag, OptimizerConfig field, type): the optimizer options, shared with l2l-launch.
OPTIMIZER_FLAGS = [("--lr", "lr", float), ("--weight-decay", "weight_decay", float),
                   ("--beta1", "beta1", float), ("--beta2", "beta2", float),
                   ("--adam-eps", "eps", float), ("--momentum", "momentum", float),
                   ("--lr-schedule", "schedule", str), ("--warmup-steps", "warmup_steps", int),
                   ("--total-steps", "total_steps", int),
                   ("--min-lr-ratio", "min_lr_ratio", float),
                   ("--clip-norm", "clip_norm", float)]
# (flag, ServerConfig field, type): update semantics, shared with l2l-launch.
UPDATE_FLAGS = [("--update", "update", str), ("--loss-scale", "loss_scale", float),
                ("--loss-scale-window", "loss_scale_window", int)]


def add_optimizer_args(p: argparse.ArgumentParser) -> None:
    d, s = OptimizerConfig(), ServerConfig()
    g = p.add_argument_group("optimizer and updates (run by the EPS)")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default=d.name)
    for flag, name, typ in OPTIMIZER_FLAGS:
        extra = {"choices": SCHEDULES} if name == "schedule" else {}
        g.add_argument(flag, dest=name if name != "eps" else "adam_eps", type=typ,
                       default=getattr(d, name), help=_doc(OptimizerConfig, name), **extra)
    for flag, name, typ in UPDATE_FLAGS:
        extra = {"choices": UPDATES} if name == "update" else {}
        g.add_argument(flag, dest=name, type=typ, default=getattr(s, name),
                       help=_doc(ServerConfig, name), **extra)


def _doc(cls, name: str) -> str:
    """--help text of a config field (the dataclasses document each field)."""
    return FIELD_HELP.get((cls.__name__, name), "")


FIELD_HELP = {
    ("OptimizerConfig", "lr"): "base learning rate",
    ("OptimizerConfig", "weight_decay"): "decoupled (AdamW, LAMB) or L2 (SGD) weight decay; "
                                         "biases and norms get none",
    ("OptimizerConfig", "momentum"): "SGD momentum",
    ("OptimizerConfig", "schedule"): "after warm-up: constant, linear or cosine decay",
    ("OptimizerConfig", "warmup_steps"): "linear warm-up over this many updates",
    ("OptimizerConfig", "total_steps"): "where the decay reaches --min-lr-ratio",
    ("OptimizerConfig", "min_lr_ratio"): "decay floor as a fraction of --lr",
    ("OptimizerConfig", "clip_norm"): "clip gradients to this norm (0: off): per layer with "
                                      "eager updates, globally with deferred ones",
    ("ServerConfig", "update"): "eager: update each layer as soon as it is reduced (overlap); "
                                "deferred: after the whole step (exact global clipping and "
                                "fp16 overflow skips)",
    ("ServerConfig", "loss_scale"): "fp16: initial dynamic loss scale",
    ("ServerConfig", "loss_scale_window"): "fp16: double the scale after this many clean steps",
}


def optimizer_config(a: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(name=a.optimizer, **{
        name: getattr(a, "adam_eps" if name == "eps" else name)
        for _, name, _ in OPTIMIZER_FLAGS})


def optimizer_argv(a: argparse.Namespace) -> list[str]:
    """The optimizer and update options of ``a`` as eps-server arguments (for l2l-launch)."""
    out = ["--optimizer", a.optimizer]
    for flag, name, _ in OPTIMIZER_FLAGS + UPDATE_FLAGS:
        out += [flag, str(getattr(a, "adam_eps" if name == "eps" else name))]
    return out


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
                           trace=a.trace, update=a.update, loss_scale=a.loss_scale,
                           loss_scale_window=a.loss_scale_window)
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
