"""l2l-worker: one L2L worker process (one device) of a job served by an eps-server."""

from __future__ import annotations

import logging
import signal
import sys

from protocol.lifecycle import die_with_parent

from .cli import model_config, parser, worker_config
from .eps_client import EpsDisconnected, EpsError
from .job import run_worker


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    die_with_parent()
    # SIGTERM unwinds like an exception, so the worker says Bye and closes its sockets.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    logging.basicConfig(level=a.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s l2l-worker[{a.rank}] %(levelname)s %(message)s")
    try:
        cfg, mcfg = worker_config(a), model_config(a)
    except ValueError as e:
        print(f"l2l-worker: {e}", file=sys.stderr)
        return 2
    try:
        run_worker(cfg, mcfg)
    except (EpsError, EpsDisconnected, TimeoutError) as e:
        logging.getLogger("l2l_worker").error("%s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
