"""LoRA on a Hugging Face model (--lora-rank): the base model frozen, the adapters trained as
PEFT trains them, saved as PEFT saves them (``PeftModel.from_pretrained`` loads the result)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from protocol.tensors import plan_layout
from worker.config import ModelConfig
from worker.models import build_model

from . import hf_fixtures as fx
from .baseline import assert_close
from .helpers import ENV
from .hf_baseline import train_hf
from .test_launch import LAUNCH

peft = pytest.importorskip("peft")
SEQ = 16
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q_proj,v_proj"]


def _initial_adapter(path, out) -> None:
    """The adapter l2l starts from (PEFT's initialisation, seeded), written as l2l saves it."""
    model = build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ, lora_rank=4, lora_alpha=8))
    tensors = {}
    for plan in plan_layout(model.manifest()).layers:
        values = model.loader().load(plan)
        tensors.update({(plan.name, n): values[n] for n in model.exported(plan)})
    model.export(str(out), tensors, {})


def test_lora_trains_as_peft_and_saves_what_peft_loads(tmp_path):
    """A tiny Llama (grouped-query attention), 2 workers, 3 AdamW steps, dropout 0: the
    adapter l2l saves equals PEFT's training of the resident model from the same initial
    adapter (FP32, 1e-5 + 1e-4 rel); PEFT loads it; the EPS holds the base model's served copy
    only (no master or optimizer state for it)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = fx.model_dir(tmp_path / "model", "llama", attention_dropout=0.0)
    data = fx.lm_jsonl(tmp_path / "train.jsonl")
    out = tmp_path / "adapter"
    p = subprocess.run([*LAUNCH, "--workers", "2", "--model", f"hf:{path}", *LORA,
                        "--data", str(data), "--seq-len", str(SEQ), "--micro-batch-size", "4",
                        "--micro-batches", "1", "--threads", "1", "--steps", "3", "--lr", "1e-2",
                        "--save", str(out), "--summary-json", str(tmp_path / "s.json")],
                       env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr
    got = load_file(str(out / "adapter_model.safetensors"))
    assert got and all(".lora_" in k for k in got)

    init = tmp_path / "init"
    _initial_adapter(path, init)
    from worker.config import DataConfig

    trained = train_hf(str(path), DataConfig(data=str(data)), steps=3, micro_batches=2,
                       batch_size=4, seq_len=SEQ, lr=1e-2,
                       wrap=lambda hf: PeftModel.from_pretrained(hf, str(init), is_trainable=True))
    want = {k.replace(".default", ""): v for k, v in trained.items() if ".lora_" in k}
    assert_close(got, want, atol=1e-5, rtol=1e-4)
    start = load_file(str(init / "adapter_model.safetensors"))
    assert not all(torch.equal(got[k], start[k]) for k in got)  # it trained

    base = AutoModelForCausalLM.from_pretrained(str(path))
    loaded = PeftModel.from_pretrained(base, str(out))  # PEFT reads the adapter l2l wrote
    ids = torch.tensor([[5, 6, 7, 8]])
    assert not torch.equal(loaded(input_ids=ids).logits,
                           AutoModelForCausalLM.from_pretrained(str(path))(input_ids=ids).logits)

    eps = json.loads((tmp_path / "s.json").read_text())["eps"]
    layout = plan_layout(build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ, lora_rank=4))
                         .manifest())
    trained_numel = sum(p.trainable for p in layout.layers)
    assert trained_numel < layout.total_numel / 10
    # fp32: the served copy (4 B) of everything, master + AdamW (12 B) of the adapter
    assert eps["model_bytes"] == (4 * layout.total_numel + 12 * trained_numel
                                  + 4 * len(layout.layers))


def test_merge_writes_the_base_model_with_the_adapter_folded_in(tmp_path):
    """--merge from an EPS checkpoint (l2l-export): W + alpha/r B A, a plain model the
    library loads, whose logits are the adapted model's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = fx.model_dir(tmp_path / "model", "llama", attention_dropout=0.0)
    data = fx.lm_jsonl(tmp_path / "train.jsonl")
    p = subprocess.run([*LAUNCH, "--workers", "1", "--model", f"hf:{path}", *LORA,
                        "--data", str(data), "--seq-len", str(SEQ), "--micro-batch-size", "4",
                        "--threads", "1", "--steps", "2", "--lr", "1e-2", "--save",
                        str(tmp_path / "adapter"), "--server-save", str(tmp_path / "ck")],
                       env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr
    p = subprocess.run([sys.executable, "-m", "worker.export", str(tmp_path / "ck"),
                        str(tmp_path / "merged"), "--merge"], env=ENV, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(path)),
                                        str(tmp_path / "adapter"))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits,
                                   adapted(input_ids=ids).logits, atol=1e-5, rtol=1e-4)


def test_lora_refuses_a_classifier_whose_head_would_be_new(tmp_path):
    """Adapters only: a causal LM given --classes (a new, random head) would never learn it."""
    path = fx.model_dir(tmp_path / "model", "llama")
    with pytest.raises(ValueError, match="would stay at its random start"):
        build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ, classes=3, lora_rank=4))
    cls = fx.model_dir(tmp_path / "cls", "llama-cls")  # its own head: adapters on its blocks
    manifest = build_model(ModelConfig(model=f"hf:{cls}", seq_len=SEQ, lora_rank=4)).manifest()
    trained = {t.name for la in manifest.layers for t in la.tensors if t.group != "frozen"}
    assert trained and all(".lora_" in n for n in trained)
