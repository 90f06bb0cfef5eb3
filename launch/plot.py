"""l2l-plot: pictures of finished runs from their summaries (runs/<id>/summary.json).

    l2l-plot runs/a1b2c3d4/summary.json --png loss.png
    l2l-plot runs/fp32/summary.json runs/bf16/summary.json --labels fp32,bf16 --png cmp.png

One figure: training loss per step (thin) with its moving average (thick), the evaluation
metric (accuracy or perplexity) when the runs evaluated, and throughput (samples/s) per step.
Several summaries are drawn on the same axes, one colour per run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def moving_average(xs: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, x in enumerate(xs):
        total += x
        if i >= window:
            total -= xs[i - window]
        out.append(total / min(i + 1, window))
    return out


def label_of(path: str, summary: dict) -> str:
    """The run's directory name (runs/<id>/summary.json), else the file's name."""
    parent = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return parent if os.path.basename(path) == "summary.json" else os.path.splitext(
        os.path.basename(path))[0]


def plot(paths: list[str], png: str, labels: list[str] | None = None, window: int = 10) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for i, path in enumerate(paths):
        with open(path) as f:
            s = json.load(f)
        if not s.get("losses"):
            raise ValueError(f"{path}: no steps recorded")
        runs.append((labels[i] if labels else label_of(path, s), s))
    evals = any(s.get("eval") for _, s in runs)
    panels = 3 if evals else 2
    fig, axes = plt.subplots(panels, 1, figsize=(9, 3.2 * panels), sharex=True)
    for k, (label, s) in enumerate(runs):
        color = f"C{k}"
        first = s.get("first_step") or 0
        steps = list(range(first + 1, first + 1 + len(s["losses"])))
        axes[0].plot(steps, s["losses"], color=color, alpha=0.3, linewidth=0.8)
        axes[0].plot(steps, moving_average(s["losses"], window), color=color, label=label)
        if evals and s.get("eval"):
            kind = "accuracy" if s["eval"][0].get("objective") == "classify" else "perplexity"
            axes[1].plot([e["step"] for e in s["eval"]], [e[kind] for e in s["eval"]],
                         marker="o", color=color, label=f"{label} ({kind})")
        if s.get("throughput"):
            axes[-1].plot(steps, s["throughput"], color=color, label=label)
    axes[0].set_ylabel(f"training loss\n(moving average of {window})")
    if evals:
        axes[1].set_ylabel("evaluation")
    axes[-1].set_ylabel("samples/s")
    axes[-1].set_xlabel("step")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="l2l-plot", description=__doc__.split("\n")[0])
    p.add_argument("summaries", nargs="+", help="summary.json files of finished runs")
    p.add_argument("--png", required=True, help="write the figure here")
    p.add_argument("--labels", default="", help="comma-separated names, one per summary "
                   "(default: each run's directory name)")
    p.add_argument("--window", type=int, default=10,
                   help="steps in the loss moving average (default: %(default)s)")
    a = p.parse_args(argv)
    labels = a.labels.split(",") if a.labels else None
    if labels and len(labels) != len(a.summaries):
        p.error(f"{len(labels)} labels for {len(a.summaries)} summaries")
    try:
        plot(a.summaries, a.png, labels, max(1, a.window))
    except (OSError, ValueError, KeyError) as e:
        print(f"l2l-plot: {e}", file=sys.stderr)
        return 1
    print(a.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
