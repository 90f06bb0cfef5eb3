"""Forward graphs kept under an activation budget (worker/keep.py): the loop that keeps the
last blocks' graphs trains exactly as the loop that recomputes them (same dropout masks),
and it keeps as many blocks as the budget holds, measured in its first step."""

from __future__ import annotations

import json

import pytest
import torch

from worker.config import ModelConfig
from worker.keep import GraphBudget, Kept, SavedBytes, graph_bytes

from . import hf_fixtures as fx
from .baseline import assert_close, train_local_l2l


def cfg(model: str, **kw) -> ModelConfig:
    base = dict(model=model, layers=4, hidden=32, heads=2, seq_len=16, vocab=64, dropout=0.2)
    base.update(kw)
    return ModelConfig(**base)


def both(c: ModelConfig, data=None, **kw) -> tuple[dict, dict]:
    """The final weights after 4 AdamW steps recomputing every block (budget 0: the last
    one's graph kept) and keeping every block's graph from the second step on."""
    run = dict(steps=4, micro_batches=2, batch_size=4, data=data, **kw)
    ex: list = []
    recomputed = train_local_l2l(c, activation_budget_gib=0.0, **run)
    kept = train_local_l2l(c, activation_budget_gib=1.0, executors=ex, **run)
    blocks = len(ex[0].plans) - 2
    assert ex[0].budget.blocks >= blocks - 1  # 1 GiB: all of them
    return recomputed, kept


def assert_equal_within(got: dict, want: dict, tol: float = 1e-6) -> None:
    assert_close(got, want, atol=tol, rtol=0.0)


@pytest.mark.parametrize("model, kw", [
    ("bert", {}), ("gpt", {"tie_embeddings": True}),
    ("tests.toy_model:SharedEmbeddingModel", {}),  # every block reads the embedding (a tie)
    ("tests.toy_model:GatedModel", {})])  # tuple boundaries with an integer member
def test_keeping_every_block_trains_as_recomputing_them(model, kw):
    recomputed, kept = both(cfg(model, **kw))
    assert_equal_within(kept, recomputed)


def test_keeping_blocks_with_layer_drop_trains_as_recomputing_them():
    recomputed, kept = both(cfg("bert", layers=6), layer_drop=0.4)
    assert_equal_within(kept, recomputed)


def test_keeping_the_blocks_of_a_hugging_face_model(tmp_path):
    path = fx.model_dir(tmp_path / "model", "llama")
    data_cfg = __import__("worker.config", fromlist=["DataConfig"]).DataConfig(
        data=str(fx.lm_jsonl(tmp_path / "train.jsonl")))
    recomputed, kept = both(ModelConfig(model=f"hf:{path}", seq_len=16), data=data_cfg)
    assert_equal_within(kept, recomputed)


def test_the_budget_holds_as_many_blocks_as_fit_from_the_step_after_measuring():
    from bench.local import LocalSource
    from eps_server.config import OptimizerConfig
    from protocol.tensors import plan_layout
    from worker.data import Sharder, build_task
    from worker.executor import Executor
    from worker.models import build_model

    model = build_model(cfg("bert", layers=8))
    layout = plan_layout(model.manifest())
    task = build_task(model, None, micro_batch_size=4, global_micro_batches=2)

    def executor(gib: float) -> Executor:
        source = LocalSource(model, layout, OptimizerConfig(lr=1e-3))
        return Executor(model, layout, source, Sharder(task, 4, 2), device=torch.device("cpu"),
                        micro_batches=range(2), steps=3, dropout=model.dropout, seed=0,
                        budget=GraphBudget(gib, torch.device("cpu")))

    probe = executor(0.0)
    probe.run_step(0)
    per_block = probe.budget.per_block
    # a block's graph: at least its weights and its two micro-batches' outputs
    block = layout.layers[1]
    assert per_block > block.numel * 4 + 2 * 4 * 16 * 32 * 4
    for fit in (0, 3, 20):
        ex = executor((fit * per_block + per_block // 2) / 2**30)
        assert ex.budget.kept(list(range(10))) == (8, [])  # nothing measured yet
        ex.run_step(0)
        assert ex.budget.blocks == fit and ex.budget.most == 1
        held, cloned = ex.budget.kept(list(range(10)))
        assert held == 8 and cloned == list(range(max(1, 8 - fit), 8))
        ex.run_step(1)
        assert ex.budget.most == 1 + min(fit, 7)
    assert GraphBudget(-1, torch.device("cpu")).bytes == 0  # auto on the CPU: none


def test_graph_bytes_count_each_saved_storage_once_and_the_weights():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    saved = SavedBytes()
    with saved.hooks():
        h = x @ w           # saves x and w (neither counted as activations)
        y = torch.tanh(h)   # saves its output y
        z = y * y           # saves y twice: once
    kept = Kept({"w": w, "tied": w[:2]}, [x], [z])
    # w (private), x (the input), y, z; not the tied view
    assert graph_bytes(kept, saved, [w]) == 8 * 8 * 4 + 3 * (4 * 8 * 4)


def test_kept_copies_free_the_workers_two_weight_buffers(cluster, tmp_path):
    """Real processes, weights copied into the worker's two buffers as on CUDA
    (--copy-weights): a kept block's copy gives its buffer back in the forward, so keeping
    every block runs within two buffers, reports what it kept, and trains as recomputing."""
    from safetensors.torch import load_file

    from .helpers import SMALL

    got = {}
    for gib in ("0", "1"):
        path = tmp_path / f"m{gib}.safetensors"
        cluster.run_job(1, *SMALL, "--layers", "4", "--steps", "3", "--micro-batches", "2",
                        "--copy-weights", "--activation-budget-gib", gib, "--save", str(path),
                        "--summary-json", str(tmp_path / f"s{gib}.json"),
                        server_args=("--lr", "1e-3"))
        got[gib] = load_file(str(path))
        summary = json.loads((tmp_path / f"s{gib}.json").read_text())
        assert summary["kept_blocks"] == (1 if gib == "0" else 4), summary
    assert_equal_within(got["1"], got["0"])
