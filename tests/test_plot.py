"""l2l-plot draws finished runs from their summaries; bad input is refused by name."""

from __future__ import annotations

import json
import math

import pytest

from launch.plot import main, moving_average

matplotlib = pytest.importorskip("matplotlib")
pytest.importorskip("matplotlib.image")


def summary(path, losses, evals=(), objective="lm"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "losses": losses, "first_step": 0, "throughput": [100.0 + i for i in range(len(losses))],
        "eval": [{"step": s, "loss": v, "accuracy": 0.0, "perplexity": math.exp(v),
                  "objective": objective} for s, v in evals]}))
    return str(path)


def test_two_runs_on_one_figure(tmp_path):
    a = summary(tmp_path / "runs" / "fp32" / "summary.json", [3.0 - 0.1 * i for i in range(20)],
                [(10, 2.5), (20, 2.0)])
    b = summary(tmp_path / "bf16.json", [3.0 - 0.09 * i for i in range(20)], [(10, 2.6)])
    png = tmp_path / "cmp.png"
    assert main([a, b, "--png", str(png)]) == 0
    image = matplotlib.image.imread(str(png))
    assert image.shape[0] > image.shape[1] > 500  # three panels stacked


def test_bad_input_is_refused(tmp_path, capsys):
    empty = summary(tmp_path / "e.json", [])
    assert main([empty, "--png", str(tmp_path / "x.png")]) == 1
    assert "no steps recorded" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.json"), "--png", str(tmp_path / "x.png")]) == 1
    with pytest.raises(SystemExit):
        main([empty, "--png", str(tmp_path / "x.png"), "--labels", "a,b"])


def test_moving_average():
    assert moving_average([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]
