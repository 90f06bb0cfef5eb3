"""l2l-ctl: look at and steer a running eps-server.

    l2l-ctl [--run ID | --endpoint E] status [--watch] [--json]
                                                  workers, layers, counters: a table (redrawn
                                                  every --interval s with --watch), or JSON
    l2l-ctl [--endpoint E] set lr=1e-4 clip_norm=1.0
                                                  change hyperparameters from the next update
    l2l-ctl [--endpoint E] save DIR               checkpoint at the next step boundary
    l2l-ctl cleanup [--dry-run]                   remove shared memory left by dead servers
    l2l-ctl keygen DIR NAME                       write a CURVE key pair (NAME.key, .key_secret)

Without --endpoint it talks to the l2l-launch job running under --runs-dir (runs/<id>/endpoint,
kept while the job runs): the only one, or --run ID's; else to eps-server's default endpoint.
l2l-ctl says Hello as an observer: it never takes or evicts a worker's rank. Over tcp with
CURVE, give --curve-server-key (the EPS's NAME.key) and --curve-key (this client's
NAME.key_secret, whose public half is among the EPS's --curve-clients).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from protocol import curve
from protocol.cli import Parser
from protocol.endpoints import default_endpoint
from protocol.messages import Save, SetHyper
from protocol.shm import orphaned, remove_orphans
from worker.eps_client import EpsClient, EpsDisconnected, EpsError

from .config import LaunchConfig
from .rundir import running_jobs


def parse_value(text: str):
    """``1e-4`` -> float, ``100`` -> int, ``cosine`` -> str."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def job_options(p: argparse.ArgumentParser, defaults: bool = True) -> None:
    """Which job: before the command, and after it (there a given one overrides)."""
    def default(value):
        return value if defaults else argparse.SUPPRESS

    p.add_argument("--endpoint", default=default(""),
                   help="the EPS's endpoint (default: the l2l-launch job running under "
                        f"--runs-dir, else {default_endpoint()})")
    p.add_argument("--run", default=default(""), metavar="ID",
                   help="the l2l-launch job with this run id (under --runs-dir)")
    p.add_argument("--runs-dir", default=default(LaunchConfig.runs_dir),
                   help="where l2l-launch keeps its jobs' run directories (default: "
                        f"{LaunchConfig.runs_dir})")


def seconds(text: str) -> float:
    """A time in seconds: positive and finite."""
    value = float(text)
    if not 0 < value < 1e9:  # (NaN fails too)
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="l2l-ctl", description=__doc__.split("\n")[0])
    job_options(p)
    p.add_argument("--timeout", type=seconds, default=10.0,
                   help="seconds to wait for a reply (default: %(default)s)")
    p.add_argument("--curve-server-key", default="", help="CURVE: the EPS's public key file")
    p.add_argument("--curve-key", default="", help="CURVE: this client's secret key file")
    sub = p.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="the job, its workers and its layers")
    st.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    st.add_argument("--watch", action="store_true", help="redraw until Ctrl-C")
    st.add_argument("--interval", type=seconds, default=1.0,
                    help="seconds between redraws (default: %(default)s)")
    s = sub.add_parser("set", help="change optimizer settings from the next layer update, "
                       "e.g. lr=1e-4 clip_norm=1.0")
    s.add_argument("changes", nargs="+", metavar="KEY=VALUE")
    v = sub.add_parser("save", help="write a checkpoint at the next step boundary")
    v.add_argument("path")
    for command in (st, s, v):
        job_options(command, defaults=False)
    c = sub.add_parser("cleanup", help="remove this user's shared-memory regions whose "
                       "eps-server is gone (a live server's regions are never touched)")
    c.add_argument("--dry-run", action="store_true", help="only list them")
    k = sub.add_parser("keygen", help="write a CURVE key pair: DIR/NAME.key (public, give it to "
                       "the other side) and DIR/NAME.key_secret (mode 0600, keep it)")
    k.add_argument("dir")
    k.add_argument("name")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    if a.command == "cleanup":
        return cleanup(a.dry_run)
    if a.command == "keygen":
        try:
            public, secret = curve.generate(a.dir, a.name)
        except OSError as e:
            print(f"l2l-ctl: {e}", file=sys.stderr)
            return 1
        print(json.dumps({"public": public, "secret": secret}, indent=1))
        return 0
    job = "" if a.endpoint else find_job(p, a.runs_dir, a.run)
    endpoint = a.endpoint or job or default_endpoint()
    sock = endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None
    if sock is not None and not os.path.exists(sock):  # else: 10 s, then "no reply"
        none = "" if a.endpoint or job else f"no l2l-launch job runs under {a.runs_dir}/, and "
        print(f"l2l-ctl: {none}no eps-server listens on {endpoint} (no such socket file); "
              "give its --endpoint", file=sys.stderr)
        return 1
    try:
        client = EpsClient(endpoint, timeout=a.timeout,
                           curve=curve.client_keys(a.curve_server_key, a.curve_key))
    except ValueError as e:
        print(f"l2l-ctl: {e}", file=sys.stderr)
        return 1
    try:
        client.observe()
        if a.command == "status" and a.watch:
            from .status import watch
            watch(client, a.interval, a.json)
            out = None
        elif a.command == "status":
            from .status import as_json, render, show

            r = client.status()
            if not a.json:
                show(render(r))
                out = None
            else:
                out = as_json(r)
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
        client.bye(0, done=False)  # an observer leaves (else it is dropped after the timeout)
    except (EpsError, EpsDisconnected, TimeoutError, ValueError, OverflowError) as e:
        print(f"l2l-ctl: {e}", file=sys.stderr)  # (OverflowError: a value msgpack cannot carry)
        return 1
    finally:
        client.close()
    if out is not None:
        print(json.dumps(out, indent=1))
    return 0


def find_job(p: argparse.ArgumentParser, runs_dir: str, run: str) -> str:
    """The endpoint of the l2l-launch job running under ``runs_dir`` (``run``'s, or the only
    one), or "" if none runs; a usage error where that is ambiguous."""
    jobs = running_jobs(runs_dir)
    if run and run not in jobs:
        p.error(f"no job {run} runs under {runs_dir}/ (running: {', '.join(jobs) or 'none'})")
    if run or len(jobs) == 1:
        return jobs[run or next(iter(jobs))]
    if jobs:
        p.error(f"{len(jobs)} jobs run under {runs_dir}/: {', '.join(jobs)}; pick one with "
                "--run ID")
    return ""


def cleanup(dry_run: bool) -> int:
    if dry_run:
        out = {run: names for run, names in orphaned().items()}
    else:
        out = {run: {"regions": n, "bytes": size} for run, (n, size) in remove_orphans().items()}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
