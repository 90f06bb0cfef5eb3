"""--freeze: frozen tensors are served and back-propagated through, never pushed or updated;
the EPS holds one copy of them (in fp32 the master, served as it is; else the served copy).
Training equals the resident model trained with the same parameters frozen
(``requires_grad_(False)``)."""

from __future__ import annotations

import json
import subprocess

from safetensors.torch import load_file

from protocol.tensors import plan_layout
from worker.config import ModelConfig
from worker.export import main as export_main
from worker.models import build_model

from .baseline import assert_close, train_resident
from .helpers import ENV
from .test_launch import LAUNCH

MODEL = ["--model", "gpt", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16",
         "--vocab", "64", "--tie-embeddings"]
# the embedding (and the head tied to it), all of block 1 (a layer with nothing to train),
# block 0's attention
FREEZE = "pre.*,blocks.1.*,blocks.0.attn.*"


def test_frozen_tensors_train_as_the_resident_model_with_them_frozen(tmp_path):
    """2 workers x 2 micro-batches, 4 AdamW steps, dropout on: the frozen tensors end where
    they began, the others as torch trains them; the EPS holds no master or optimizer state
    for the frozen ones (its bytes per parameter fall)."""
    steps, u, b = 4, 2, 4
    p = subprocess.run([*LAUNCH, "--workers", "2", *MODEL, "--freeze", FREEZE,
                        "--micro-batches", str(u), "--micro-batch-size", str(b),
                        "--threads", "1", "--steps", str(steps), "--lr", "3e-3",
                        "--save", str(tmp_path / "frozen.st"), "--summary-json",
                        str(tmp_path / "frozen.json")],
                       env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr
    eps = json.loads((tmp_path / "frozen.json").read_text())["eps"]
    got = load_file(str(tmp_path / "frozen.st"))
    mcfg = ModelConfig(model="gpt", layers=2, hidden=32, heads=2, seq_len=16, vocab=64,
                       tie_embeddings=True, freeze=FREEZE)
    want = train_resident(mcfg, steps=steps, global_micro_batches=2 * u, batch_size=b,
                          lr=3e-3)
    assert_close(got, want, atol=1e-5, rtol=1e-4)
    start = train_resident(mcfg, steps=0, global_micro_batches=2 * u, batch_size=b)
    for name in ("pre.tok.weight", "blocks.1.mlp.fc.weight", "blocks.0.attn.qkv.weight"):
        assert (got[name] == start[name]).all(), name
    assert not (got["blocks.0.mlp.fc.weight"] == start["blocks.0.mlp.fc.weight"]).all()
    # fp32: one copy of every element, the master served as it is (4 B), AdamW's m, v (8 B)
    # of the trained ones only, and each layer's step count (nothing frozen: 16 B a param)
    layout = plan_layout(build_model(mcfg).manifest())
    trained = sum(p.trainable for p in layout.layers)
    assert trained < layout.total_numel / 2
    assert eps["model_bytes"] == 4 * layout.total_numel + 8 * trained + 4 * len(layout.layers)


def test_a_freeze_pattern_that_matches_nothing_is_refused_at_once(tmp_path):
    p = subprocess.run([*LAUNCH, "--workers", "1", *MODEL, "--freeze", "pre.*,encoder.*",
                        "--steps", "1"], env=ENV, cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2, p.stderr
    assert "--freeze 'encoder.*' matches no tensor (names look like pre.tok.weight" in p.stderr


def test_a_checkpoint_with_frozen_tensors_resumes_exactly(tmp_path):
    """bf16 compute: the frozen tensors exist only as their bf16 served copy, which the
    checkpoint keeps (and l2l-export writes); 2 more steps from step 2's checkpoint end bitwise
    where 4 steps without a stop do."""
    job = [*MODEL, "--freeze", FREEZE, "--precision", "bf16", "--threads", "1", "--lr", "3e-3"]

    def run(*extra: str) -> dict:
        p = subprocess.run([*LAUNCH, "--workers", "1", *job, *extra, "--summary-json",
                            str(tmp_path / "s.json")], env=ENV, cwd=tmp_path,
                           capture_output=True, text=True, timeout=240)
        assert p.returncode == 0, p.stderr
        return json.loads((tmp_path / "s.json").read_text())

    run("--steps", "4", "--save", str(tmp_path / "straight.st"), "--server-save",
        str(tmp_path / "ck"), "--checkpoint-every", "2", "--keep-checkpoints", "2")
    again = run("--steps", "4", "--load", str(tmp_path / "ck" / "step-00000002"), "--save",
                str(tmp_path / "resumed.st"))
    assert len(again["losses"]) == 2  # steps 3 and 4
    straight, resumed = (load_file(str(tmp_path / f)) for f in ("straight.st", "resumed.st"))
    assert_close(resumed, straight, atol=0, rtol=0)
    assert export_main([str(tmp_path / "ck"), str(tmp_path / "export.st")]) == 0  # in-process
    exported = load_file(str(tmp_path / "export.st"))
    assert exported["pre.tok.weight"].equal(straight["pre.tok.weight"])  # never trained


def test_the_backward_stops_at_the_lowest_layer_that_trains():
    """A frozen bottom (the embedding and the first of 3 blocks, as LoRA's --lora-layers or a
    frozen embedding leave it): those layers are fetched once a step, for the forward, and
    pushed as skips; the backward stops at the first block that trains. 3 AdamW steps with
    dropout equal the resident model trained with them frozen."""
    from collections import Counter

    from bench.local import LocalSource

    from .baseline import train_local_l2l

    class Spy(LocalSource):
        made: list = []

        def __init__(self, *args):
            super().__init__(*args)
            self.fetched, self.skipped, self.pushed = Counter(), Counter(), Counter()
            Spy.made.append(self)

        def weights(self, layer, version):
            self.fetched[layer] += 1
            return super().weights(layer, version)

        def skip(self, step, plan):
            self.skipped[plan.index] += 1

        def push(self, step, plan, slot, buf):
            self.pushed[plan.index] += 1
            super().push(step, plan, slot, buf)

    mcfg = ModelConfig(model="gpt", layers=3, hidden=32, heads=2, seq_len=16, vocab=64,
                       freeze="pre.*,blocks.0.*")
    got = train_local_l2l(mcfg, steps=3, micro_batches=2, batch_size=4, lr=3e-3, source=Spy)
    want = train_resident(mcfg, steps=3, global_micro_batches=2, batch_size=4, lr=3e-3)
    assert_close(got, want, atol=1e-5, rtol=1e-4)
    spy = Spy.made[-1]  # layers: pre 0, blocks 1-3, post 4
    assert spy.skipped == {0: 3, 1: 3} and spy.pushed == {2: 3, 3: 3, 4: 3}
    # (the last block keeps its graph, and its weights, from its forward to its backward)
    assert [spy.fetched[i] for i in range(5)] == [3, 3, 6, 3, 3]
