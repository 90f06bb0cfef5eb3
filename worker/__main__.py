"""l2l-worker: one L2L worker process (one device) of a job served by an eps-server.

Fetches one layer at a time from the EPS, runs all its micro-batches through it, pushes each
layer's gradient. Options come from worker/config.py (``--help`` lists them, ``--config FILE``
reads them); ``--events`` receives one typed event per step.
"""

from __future__ import annotations

import logging
import signal
import sys

from protocol import cli
from protocol.lifecycle import REFUSED, die_with_parent, skip_exit_collections

from .config import WorkerArgs
from .eps_client import EpsDisconnected, EpsError
from .job import LOG_RANK, ModelNotSaved, run_worker

# The EPS's refusals of the job itself (another model or protocol than it holds): a restarted
# worker would meet them again.
PERMANENT = ("manifest_mismatch", "protocol_version")


def refused_for_good(e: Exception) -> bool:
    return isinstance(e, ModelNotSaved) or isinstance(e, EpsError) and (
        e.code in PERMANENT or e.code == "bad_request" and e.field == "manifest")


def parse(argv: list[str] | None = None) -> WorkerArgs:
    return cli.parse(WorkerArgs, argv, "l2l-worker", __doc__.split("\n")[0])


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    die_with_parent(signal.SIGKILL)  # even when stopped; the EPS tells a killed process at once
    try:
        return run(args)
    finally:
        skip_exit_collections()


def run(args: WorkerArgs) -> int:
    """Train this worker's share of the job; the exit status."""
    # SIGTERM unwinds like an exception, so the worker says Bye and closes its sockets.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.worker.rank >= 0:  # -1: the rank is assigned at the join
        LOG_RANK.rank = str(args.worker.rank)
    logging.basicConfig(level=args.worker.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s l2l-worker[%(rank)s] %(levelname)s %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(LOG_RANK)
    try:
        run_worker(args)
    except (EpsError, EpsDisconnected, TimeoutError, ValueError, ModelNotSaved) as e:
        log = logging.getLogger("l2l_worker")
        log.error("%s", e, exc_info=log.isEnabledFor(logging.DEBUG))
        return REFUSED if refused_for_good(e) else 1  # (a restart would not help)
    finally:
        # Done: nothing is left to unwind, and a SIGTERM now (a launcher stopping the job as
        # this worker exits) would raise inside the interpreter's exit handlers: a traceback
        # and finalizers cut short. (The parent-death signal is SIGKILL, which still ends
        # it.)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return 0


if __name__ == "__main__":
    sys.exit(main())
