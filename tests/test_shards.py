"""``--eps-mode shard``'s cuts of a layer, and checkpoints written by N boxes read whole by a
job with any number of boxes (the multi-process runs are in test_boxes.py)."""

from __future__ import annotations

import secrets

import pytest
import torch

from eps_server.buffers import BufferPool
from eps_server.checkpoint import Loaded, load_into, read_meta, save
from eps_server.config import OptimizerConfig
from eps_server.engines import layer_maths
from eps_server.layer_store import LayerStore
from eps_server.pool import MathPool
from protocol.checkpoint_tensors import CheckpointTensors, shard_files
from protocol.safetensors_io import write_safetensors
from protocol.shards import ALIGN, Sharding, shard_plan
from protocol.tensors import LayerSpec, Manifest, TensorSpec, plan_layout, views


def toy_manifest(layers: int, hidden: int) -> Manifest:
    """Layers of a matrix, a bias (no decay) and an odd-sized vector: spans that do not
    divide evenly among 2 or 3 boxes."""
    return Manifest(layers=tuple(LayerSpec(name=f"l{i}", kind="k", tensors=(
        TensorSpec(name="w", shape=(hidden, hidden)),
        TensorSpec(name="b", shape=(hidden,), group="no_decay"),
        TensorSpec(name="g", shape=(hidden + 3,)))) for i in range(layers)),
        meta={"model": "shards-test"})


@pytest.mark.parametrize("numel", [1, 15, 16, 17, 1000, 4096 * 3 + 5])
@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_the_boxes_spans_cover_a_layer_once_on_aligned_starts(numel, count):
    spans = [Sharding(r, count).span(numel) for r in range(count)]
    assert spans[0][0] == 0 and spans[-1][1] == numel
    for (lo, hi), (lo2, _) in zip(spans, spans[1:]):
        assert lo <= hi == lo2
    assert all(lo % ALIGN == 0 or lo == numel for lo, _ in spans)
    chunk = Sharding(0, count).chunk(numel)
    assert all(hi - lo <= chunk for lo, hi in spans)
    assert Sharding(0, count).padded(numel) == count * chunk >= numel


def test_a_shard_plan_keeps_the_groups_inside_its_span():
    plan = plan_layout(toy_manifest(layers=1, hidden=32)).layers[0]
    lo, hi = Sharding(1, 3).span(plan.numel)
    part = shard_plan(plan, lo, hi, offset=7)
    assert part.numel == hi - lo and part.offset == 7 and part.tensors == ()
    for group, (s, e) in part.groups.items():
        gs, ge = plan.groups[group]
        assert (s + lo, e + lo) == (max(gs, lo), min(ge, hi))


def _store(manifest, sharding=None, states="fp32"):
    store = LayerStore(manifest, "s" + secrets.token_hex(4), "float32", sharding=sharding)
    cfg = OptimizerConfig(states=states)
    maths = layer_maths(store, cfg, MathPool(1, inline=True), BufferPool())
    return store, [m.optimizer for m in maths]


def _fill(store, optimizers, seed):
    g = torch.Generator().manual_seed(seed)
    for plan in store.layout.layers:
        flat = torch.zeros(plan.numel)  # (a checkpoint holds the tensors, not the padding)
        for view in views(flat, plan):
            view.copy_(torch.randn(view.shape, generator=g))
        store.write_initial(plan.index, flat)
        for t in optimizers[plan.index].state_tensors().values():
            if t.dim():
                t.copy_(torch.rand(t.numel(), generator=g))
            else:
                t.fill_(3)


@pytest.mark.parametrize("count", [2, 3])
def test_a_checkpoint_of_n_shards_loads_whole_and_into_other_counts(tmp_path, count):
    """A full checkpoint (one EPS) is cut into ``count`` shard files as the boxes write them;
    read back, every layer's master and state is the original, and stores of 1, 2 and 3 boxes
    each load exactly their span of it."""
    manifest = toy_manifest(layers=2, hidden=32)
    full, opts = _store(manifest)
    try:
        _fill(full, opts, 0)
        for layer in range(full.num_layers):
            full.set_version(layer, 4)
        root = tmp_path / "whole"
        path = save(str(root), full, opts, {})
        whole = read_meta(path)
        sharded = tmp_path / "sharded"
        sharded.mkdir()
        reader = CheckpointTensors(whole.path, whole.state)
        for r in range(count):
            master, state = [], []
            for plan in full.layout.layers:
                lo, hi = Sharding(r, count).span(plan.numel)
                master.append((f"{plan.name}/master", reader.master(plan)[lo:hi]))
                for k, t in reader.optimizer(plan).items():
                    state.append((f"{plan.name}/{k}", t if t.dim() == 0 else t[lo:hi]))
            for file, tensors in zip(shard_files(r, count), (master, state)):
                write_safetensors(str(sharded / file), tensors)
        split = Loaded(str(sharded), whole.manifest, {**whole.state, "shards": count})
        back = CheckpointTensors(split.path, split.state)
        for plan in full.layout.layers:
            assert torch.equal(back.master(plan), reader.master(plan))
            want = reader.optimizer(plan)
            got = back.optimizer(plan)
            assert got.keys() == want.keys()
            for k in want:
                assert torch.equal(got[k], want[k]), k
        for boxes in (1, 2, 3):
            for r in range(boxes):
                store, optimizers = _store(manifest, Sharding(r, boxes) if boxes > 1 else None)
                try:
                    load_into(split, store, optimizers)
                    for plan in store.layout.layers:
                        lo, hi = store.spans[plan.index]
                        want_master = full.master(plan.index)[lo:hi]
                        assert torch.equal(store.master(plan.index), want_master)
                        assert torch.equal(store.compute(plan.index), full.master(plan.index))
                        mine = optimizers[plan.index].state_tensors()
                        for k, t in opts[plan.index].state_tensors().items():
                            assert torch.equal(mine[k], t if t.dim() == 0 else t[lo:hi]), k
                finally:
                    store.close()
    finally:
        full.close()
