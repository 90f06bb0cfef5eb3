"""Benchmarks: each prints a side-by-side table with ratios against a baseline measured in the
same run, checks its targets, and writes JSON.

    python -m bench NAME [--json PATH] [options]      NAME: see below, or "all" (not scale,
                                                      not bootstrap)
    python -m bench NAME --help                        options of one benchmark

Exit status: 0 when every target is met, 1 when one is missed (on a noisy machine, or at a size
a target was not set for, a miss is a figure to read, not a failure of the code), 2 for a bad
command line. ``gpu`` reports a piece that failed or ran out of its budget in its rows and
JSON, not in the status (``make gpu-check`` exits 1 for a failed one).
"""

from __future__ import annotations

import argparse
import signal
import sys

from . import (
    bootstrap,
    collectives,
    engines,
    flood,
    frozen,
    gpu,
    keep,
    load,
    memory,
    multibox,
    optimizer,
    saving,
    scale,
    speed,
    states,
    transfer,
)

BENCHMARKS = {
    "throughput": (speed.add_args, speed.throughput),
    "overlap": (speed.add_args, speed.overlap),
    "innerloop": (speed.add_args, speed.innerloop),
    "memory": (memory.add_args, memory.memory),
    "keep": (keep.add_args, keep.keep),
    "frozen": (frozen.add_args, frozen.frozen),
    "transfer": (transfer.add_args, transfer.transfer),
    "scale": (scale.add_args, scale.scale),
    "optimizer": (optimizer.add_args, optimizer.optimizer),
    "engines": (engines.add_args, engines.engines),
    "states": (states.add_args, states.states),  # needs transformers and MiniLM
    "bootstrap": (bootstrap.add_args, bootstrap.bootstrap),  # needs transformers
    "load": (load.add_args, load.load),
    "recovery": (speed.add_args, speed.recovery),
    "metrics": (speed.add_args, speed.metrics),
    "flood": (flood.add_args, flood.flood),
    "multibox": (multibox.add_args, multibox.multibox),
    "collectives": (collectives.add_args, collectives.collectives),
    "saving": (saving.add_args, saving.saving),
    "gpu": (gpu.add_args, gpu.gpu),  # see bench/gpu.py; make gpu-check runs it with the tests
}
EXTRA = ("scale", "bootstrap", "gpu", "states")  # long, or needing a GPU: not in "all"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # A time budget stops a benchmark with SIGINT (bench/gpucheck.py): it must raise
    # KeyboardInterrupt even where the process was started with SIGINT ignored (a background
    # job of a script), so that the rows measured so far are kept.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    names = list(BENCHMARKS) + ["all"]
    if not argv or argv[0] not in names:
        asked = bool(argv) and argv[0] in ("-h", "--help")
        print(__doc__ + "\nbenchmarks: " + ", ".join(names), file=sys.stdout if asked
              else sys.stderr)
        return 0 if asked else 2
    from .common import report

    name, rest = argv[0], argv[1:]
    todo = [n for n in BENCHMARKS if n not in EXTRA] if name == "all" else [name]
    misses = 0
    for n in todo:
        add_args, run = BENCHMARKS[n]
        p = argparse.ArgumentParser(prog=f"python -m bench {n}",
                                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        p.add_argument("--json", default="", help="write the results here"
                       + (" (NAME is appended for 'all')" if name == "all" else ""))
        add_args(p)
        a, _ = p.parse_known_args(rest) if name == "all" else (p.parse_args(rest), None)
        path = a.json.replace(".json", f"-{n}.json") if name == "all" and a.json else a.json
        result = run(a)
        report(result, path or None)
        misses += sum(not t["ok"] for t in result["targets"])
        print()
    return 0 if misses == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
