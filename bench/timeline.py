"""Render a Chrome trace of an l2l job (``l2l-launch --trace``) as a PNG timeline.

    python -m bench.timeline trace.json --png timeline.png [--start 1.5 --end 3.0]

One row per thread (EPS math threads, each worker's main/prefetch/push threads); bars are
coloured by kind, so the overlap of worker compute with EPS reduce/update is visible at a glance.
"""

from __future__ import annotations

import argparse
import json
import sys

COLORS = {"data": "#cccc66", "forward": "#4c72b0", "backward": "#55a868", "wait": "#c44e52",
          "h2d": "#8172b2", "d2h": "#937860", "reduce": "#dd8452", "update": "#da8bc3",
          "checkpoint": "#8c8c8c"}


def load(path: str):
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {}
    for e in events:
        if e.get("ph") == "M" and e["name"] == "process_name":
            names[e["pid"], None] = e["args"]["name"]
        elif e.get("ph") == "M" and e["name"] == "thread_name":
            names[e["pid"], e["tid"]] = e["args"]["name"]
    spans = [e for e in events if e.get("ph") == "X"]
    return spans, names


def render(trace: str, png: str, start: float | None = None, end: float | None = None) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans, names = load(trace)
    if not spans:
        raise SystemExit(f"{trace}: no spans")
    t0 = min(e["ts"] for e in spans)
    rows = sorted({(e["pid"], e["tid"]) for e in spans},
                  key=lambda r: (not names.get((r[0], None), "").startswith("eps"),
                                 names.get((r[0], None), ""), r[1]))
    index = {r: i for i, r in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(16, 0.45 * len(rows) + 1.5))
    shown = 0
    for e in spans:
        s = (e["ts"] - t0) / 1e6
        d = e["dur"] / 1e6
        if (start is not None and s + d < start) or (end is not None and s > end):
            continue
        ax.broken_barh([(s, d)], (index[e["pid"], e["tid"]] - 0.4, 0.8),
                       color=COLORS.get(e.get("cat"), "#999999"), linewidth=0)
        shown += 1
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{names.get((p, None), p)} / {names.get((p, t), t)}" for p, t in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    if start is not None or end is not None:
        ax.set_xlim(start or 0, end)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], ncol=len(COLORS),
              loc="upper center", bbox_to_anchor=(0.5, -0.25 - 0.6 / len(rows)), frameon=False)
    ax.set_title("l2l timeline")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return shown


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.timeline", description=__doc__)
    p.add_argument("trace")
    p.add_argument("--png", required=True)
    p.add_argument("--start", type=float, default=None, help="seconds from the first event")
    p.add_argument("--end", type=float, default=None)
    a = p.parse_args(argv)
    n = render(a.trace, a.png, a.start, a.end)
    print(f"{a.png}: {n} spans")
    return 0


if __name__ == "__main__":
    sys.exit(main())
