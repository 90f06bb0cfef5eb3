"""l2l-ctl: look at and steer a running eps-server.

    l2l-ctl [--endpoint E] status                 versions, ranks, counters (JSON)
    l2l-ctl [--endpoint E] set lr=1e-4 clip_norm=1.0
                                                  change hyperparameters from the next update
    l2l-ctl [--endpoint E] save DIR               checkpoint at the next step boundary
    l2l-ctl cleanup [--dry-run]                   remove shared memory left by dead servers

Control requests are accepted over the server's ipc socket (its directory is readable only by
the server's user); over tcp only a registered worker may send them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from protocol.endpoints import default_endpoint
from protocol.messages import Save, SetHyper
from protocol.shm import orphaned, remove_orphans
from worker.eps_client import EpsClient, EpsDisconnected, EpsError


def parse_value(text: str):
    """``1e-4`` -> float, ``100`` -> int, ``cosine`` -> str."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="l2l-ctl", description=__doc__.split("\n")[0])
    p.add_argument("--endpoint", default=default_endpoint())
    p.add_argument("--timeout", type=float, default=10.0)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("status")
    s = sub.add_parser("set")
    s.add_argument("changes", nargs="+", metavar="KEY=VALUE")
    v = sub.add_parser("save")
    v.add_argument("path")
    c = sub.add_parser("cleanup", help="remove this user's shared-memory regions whose "
                       "eps-server is gone (a live server's regions are never touched)")
    c.add_argument("--dry-run", action="store_true", help="only list them")
    a = p.parse_args(argv)
    if a.command == "cleanup":
        return cleanup(a.dry_run)
    try:
        client = EpsClient(a.endpoint, timeout=a.timeout)
    except ValueError as e:
        print(f"l2l-ctl: {e}", file=sys.stderr)
        return 1
    try:
        if a.command == "status":
            r = client.status()
            out = {"run_id": r.run_id, "step": r.step, "world_size": r.world_size,
                   "ranks": list(r.ranks), "versions": list(r.versions), "stats": r.stats}
        elif a.command == "set":
            changes = {}
            for item in a.changes:
                key, eq, value = item.partition("=")
                if not eq:
                    p.error(f"expected KEY=VALUE, got {item!r}")
                changes[key] = parse_value(value)
            out = client.call(SetHyper, changes=changes).optimizer
        else:
            # A checkpoint waits for the current step to finish: allow it an hour.
            client.wait(client.request(Save, path=os.path.abspath(a.path)), timeout=3600)
            out = {"saved": a.path}
    except (EpsError, EpsDisconnected, TimeoutError, ValueError) as e:
        print(f"l2l-ctl: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(json.dumps(out, indent=1))
    return 0


def cleanup(dry_run: bool) -> int:
    if dry_run:
        out = {run: names for run, names in orphaned().items()}
    else:
        out = {run: {"regions": n, "bytes": size} for run, (n, size) in remove_orphans().items()}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
