"""eps-server: the standalone Eager Param-Server process.

    eps-server --world-size 2 --lr 1e-3 [--endpoint ipc:///tmp/l2l-$UID/eps.sock]

Options come from eps_server/config.py (``--help`` lists them, ``--config FILE`` reads them).
Logs go to stderr; ``--events`` receives typed events (ready, final statistics). SIGTERM and
SIGINT stop it cleanly: shared memory unlinked, final checkpoint written when --server-save is
given and no step is half done.
"""

from __future__ import annotations

import logging
import sys

import uvloop

from protocol import cli
from protocol.lifecycle import REFUSED, die_with_parent, skip_exit_collections

from .boxes import BoxLost
from .config import ServerArgs, ServerConfig
from .server import EpsServer


def parse(argv: list[str] | None = None) -> ServerArgs:
    return cli.parse(ServerArgs, argv, "eps-server", __doc__.split("\n")[0])


BOX_LOST = 3  # exit status: another box of the job died or was cut off


def main(argv: list[str] | None = None) -> int:
    cfg = parse(argv).server
    die_with_parent()
    try:
        return run(cfg)
    finally:
        skip_exit_collections()


def more_descriptors() -> None:
    """The soft limit on open files raised to the hard one: every connection holds one, and a
    flood of them (on a tcp endpoint, before any authentication) must not leave the EPS none
    to write a checkpoint with."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


def run(cfg: ServerConfig) -> int:
    """Serve until the job is done or a signal stops it; the exit status."""
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s eps-server %(levelname)s %(message)s")
    more_descriptors()
    server = EpsServer(cfg)
    try:
        uvloop.run(server.serve())
    except (ValueError, OSError) as e:  # bad settings, a port or file the machine refused
        logging.getLogger("eps_server").error("%s", e)
        return REFUSED
    except BoxLost as e:  # the other boxes did not come (a restart may find them)
        logging.getLogger("eps_server").error("%s", e)
        return 1
    finally:
        server.close()
    if server.box_lost:  # a launcher restarts the job from its last checkpoint, if it may
        logging.getLogger("eps_server").error("stopping: %s", server.box_lost)
        return BOX_LOST
    return 0


if __name__ == "__main__":
    sys.exit(main())
