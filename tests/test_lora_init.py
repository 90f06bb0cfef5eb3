"""--lora-init DIR: LoRA that starts from a PEFT adapter (its config, its tensors) trains as
``PeftModel.from_pretrained(base, DIR, is_trainable=True)`` trains; an adapter l2l cannot
build, or one of another model, is refused with what is wrong."""

from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from protocol.lifecycle import REFUSED
from protocol.tensors import plan_layout
from worker.config import ModelConfig
from worker.export import main as export_main
from worker.models import build_model

from . import hf_fixtures as fx
from .baseline import assert_close, train_local_l2l
from .helpers import ENV
from .hf_baseline import train_hf
from .test_hf import data_for
from .test_launch import LAUNCH
from .test_lora import _peft_names

peft = pytest.importorskip("peft")

SEQ = 16


def _peft_adapter(path, out, classes: int = 0, **config) -> dict[str, torch.Tensor]:
    """PEFT's adapter of the model at ``path`` (its own LoraConfig and initialisation), every
    B (and a new head) moved off its start, saved by PEFT: its tensors."""
    import transformers
    from peft import LoraConfig, get_peft_model

    auto = (transformers.AutoModelForSequenceClassification if classes
            else transformers.AutoModelForCausalLM)
    base = auto.from_pretrained(str(path), **({"num_labels": classes} if classes else {}))
    task = "SEQ_CLS" if classes else "CAUSAL_LM"
    model = get_peft_model(base, LoraConfig(task_type=task, **config))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and "lora_A" not in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(str(out))
    return load_file(str(out / "adapter_model.safetensors"))


@pytest.mark.parametrize("family, classes, config", [
    ("llama", 0, {"r": 4, "lora_alpha": 16, "use_rslora": True,
                  "target_modules": ["q_proj", "v_proj", "o_proj"]}),
    ("bert-base", 3, {"r": 2, "lora_alpha": 4, "use_dora": True,
                      "target_modules": ["query", "value"]})],
    ids=["llama-rslora", "bert-new-head-dora"])
def test_lora_init_trains_a_peft_adapter_as_peft_does(tmp_path, family, classes, config):
    """A PEFT adapter whose B (and a new classifier head, DoRA's magnitudes) are not where
    PEFT starts them: its config sets l2l's LoRA options, and 3 AdamW steps through the
    executor from its tensors equal PEFT's training of the library model from
    ``PeftModel.from_pretrained(base, DIR, is_trainable=True)`` (FP32, 1e-5 + 1e-4 rel)."""
    from peft import PeftModel

    path = fx.model_dir(tmp_path / "model", family, biases=True)
    data = data_for(family, tmp_path, classes=classes)
    init = tmp_path / "init"
    start = _peft_adapter(path, init, classes, **config)
    cfg = ModelConfig(model=f"hf:{path}", seq_len=SEQ, classes=classes, lora_init=str(init))
    assert (cfg.lora_rank, cfg.lora_alpha) == (config["r"], config["lora_alpha"])
    assert (cfg.lora_rslora, cfg.lora_dora) == (config.get("use_rslora", False),
                                                config.get("use_dora", False))
    assert cfg.lora_targets == ",".join(sorted(config["target_modules"]))
    got = train_local_l2l(cfg, steps=3, micro_batches=2, batch_size=4, data=data, lr=1e-2)
    want = _peft_names(train_hf(
        str(path), data, steps=3, micro_batches=2, batch_size=4, seq_len=SEQ, lr=1e-2,
        classes=classes, wrap=lambda hf: PeftModel.from_pretrained(hf, str(init),
                                                                   is_trainable=True)))
    assert_close(got, {k: want[k] for k in got}, atol=1e-5, rtol=1e-4)
    trained = {k.removeprefix("base_model.model."): v for k, v in start.items()}
    assert set(trained) == {k for k in got if k in trained} and len(trained) > 2
    assert not any(torch.equal(got[k], v) for k, v in trained.items())  # all of them moved


@pytest.mark.parametrize("family", ["llama", "gemma3-vlm"])
def test_an_adapter_l2l_saved_starts_where_it_ended(tmp_path, family):
    """An adapter --save wrote (here: seeded values moved, as training moves them) read back
    with --lora-init: the loader gives its tensors exactly, the base model's from the
    checkpoint; the options come from its config (a multimodal model's language model: the
    pattern --save writes for its targets)."""
    path = fx.model_dir(tmp_path / "model", family)
    cfg = ModelConfig(model=f"hf:{path}", seq_len=SEQ, lora_rank=4, lora_alpha=8,
                      lora_targets="q_proj,k_proj", lora_rslora=True)
    model = build_model(cfg)
    tensors = {}
    for plan in plan_layout(model.manifest()).layers:
        tensors.update({(plan.name, n): v + 0.01 * (n.endswith("lora_B.weight"))
                        for n, v in model.loader().load(plan).items()})
    model.export(str(tmp_path / "adapter"), dict(tensors), {})
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert isinstance(written["target_modules"], str) is family.endswith("-vlm")
    again = build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ,
                                    lora_init=str(tmp_path / "adapter")))
    assert again.cfg.lora_rslora and again.cfg.lora_targets == "k_proj,q_proj"
    loaded = 0
    for plan in plan_layout(again.manifest()).layers:
        for n, v in again.loader().load(plan).items():
            assert torch.equal(v.float(), tensors[plan.name, n]), (plan.name, n)
            loaded += ".lora_" in n
    assert loaded == 2 * 2 * again.config.num_hidden_layers  # (A and B of q_proj, k_proj)


def _adapter(tmp_path, config: dict, tensors: dict | None = None):
    out = tmp_path / "adapter"
    out.mkdir(exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
         **config}))
    if tensors is not None:
        save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


@pytest.mark.parametrize("config, given, why", [
    ({"rank_pattern": {"q_proj,k_proj": 8}}, {}, "rank_pattern"),
    ({"rank_pattern": {"q_proj": 0}}, {}, "its rank_pattern .q_proj=0."),
    ({"exclude_modules": ".*q_proj"}, {}, "exclude_modules is the pattern"),
    ({"alpha_pattern": {"q_proj": 4}}, {"lora_alpha_pattern": "q_proj=5"}, "disagrees"),
    ({"layers_to_transform": [0], "layers_pattern": "decoder"}, {}, "layers_pattern"),
    ({"layers_to_transform": [0]}, {"lora_layers": "1"}, "--lora-layers 1 disagrees"),
    ({"bias": "lora_only"}, {}, "bias"),
    ({"init_lora_weights": "pissa_niter_4"}, {}, "rewrites the base weights"),
    ({"peft_type": "IA3"}, {}, "IA3 adapter"),
    ({"target_modules": "model.*q_proj"}, {}, "pattern"),
    ({"target_modules": ["self_attn.q_proj"]}, {}, "last name"),
    ({}, {"lora_rank": 8}, "--lora-rank 8 disagrees"),
    ({}, {"lora_targets": "q_proj,k_proj"}, "--lora-targets q_proj,k_proj disagrees"),
    ({}, {"init_from": "x.safetensors"}, "not with --init-from")])
def test_an_adapter_l2l_does_not_build_is_refused(tmp_path, config, given, why):
    path = fx.model_dir(tmp_path / "model", "llama")
    init = _adapter(tmp_path, config)
    with pytest.raises(ValueError, match=why):
        ModelConfig(model=f"hf:{path}", seq_len=SEQ, lora_init=str(init), **given)
    # agreeing options (nothing trained whole: none, or PEFT's default), and a new dropout,
    # are taken
    cfg = ModelConfig(model=f"hf:{path}", seq_len=SEQ, lora_init=str(_adapter(tmp_path, {})),
                      lora_rank=4, lora_targets="v_proj,q_proj", lora_dropout=0.1,
                      lora_modules_to_save="none")
    assert (cfg.lora_rank, cfg.lora_dropout, cfg.lora_modules_to_save) == (4, 0.1, "none")
    # the adapter's dropout unless one is given (a given 0 turns it off)
    init = _adapter(tmp_path, {"lora_dropout": 0.05})
    assert ModelConfig(model=f"hf:{path}", seq_len=SEQ, lora_init=str(init)).lora_dropout == 0.05
    assert ModelConfig(model=f"hf:{path}", seq_len=SEQ, lora_init=str(init),
                       lora_dropout=0.0).lora_dropout == 0.0
    assert ModelConfig(model=f"hf:{path}", seq_len=SEQ, lora_rank=4).lora_dropout == 0.0


def test_an_adapter_of_another_model_is_refused(tmp_path):
    """Checked against the model's own adapter before anything starts: tensors missing, left
    over (other targets), or of another shape; no adapter file, or a pickled one."""
    path = fx.model_dir(tmp_path / "model", "llama")
    cfg = ModelConfig(model=f"hf:{path}", seq_len=SEQ, lora_rank=4, lora_alpha=8)
    model = build_model(cfg)
    own = {}
    for plan in plan_layout(model.manifest()).layers:
        own.update({model.adapter_name(plan.name, n): v.contiguous()
                    for n, v in model.loader().load(plan).items() if ".lora_" in n})
    one = next(iter(own))

    def refused(tensors, why, config=None):
        init = _adapter(tmp_path, config or {}, tensors)
        with pytest.raises(ValueError, match=why):
            build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ,
                                    lora_init=str(init))).manifest()

    build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ,
                            lora_init=str(_adapter(tmp_path, {}, own)))).manifest()
    refused({k: v for k, v in own.items() if k != one}, "has no " + one.replace(".", r"\."))
    refused({**own, one.replace("q_proj", "k_proj"): own[one].clone()}, "no place for")
    refused({**own, one: own[one][:2].contiguous()}, "has shape")
    # l2l-launch finds it before any process starts
    p = subprocess.run([*LAUNCH, "--workers", "1", "--model", f"hf:{path}", "--lora-init",
                        str(tmp_path / "adapter"), "--seq-len", str(SEQ), "--steps", "1"],
                       env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == REFUSED and "has shape" in p.stderr, p.stderr
    assert not (tmp_path / "runs").exists()  # no job was made
    refused(own, "has no .*k_proj", {"target_modules": ["q_proj", "v_proj", "k_proj"]})
    refused(own, "a SEQ_CLS adapter, and this job trains a CAUSAL_LM", {"task_type": "SEQ_CLS"})
    (tmp_path / "adapter" / "adapter_model.safetensors").unlink()
    (tmp_path / "adapter" / "adapter_model.bin").write_bytes(b"pickle")
    refused(None, "a pickle")


def test_lora_init_through_the_launcher_and_an_export_without_it(tmp_path):
    """l2l-launch --lora-init: the workers and the EPS take the adapter's options and values;
    the checkpoint records the options, so l2l-export needs the adapter directory no more; PEFT
    loads what --save wrote, and it moved from the start."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = fx.model_dir(tmp_path / "model", "llama", attention_dropout=0.0)
    data = fx.lm_jsonl(tmp_path / "train.jsonl")
    init = tmp_path / "init"
    start = _peft_adapter(path, init, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    p = subprocess.run([*LAUNCH, "--workers", "1", "--model", f"hf:{path}", "--lora-init",
                        str(init), "--data", str(data), "--seq-len", str(SEQ),
                        "--micro-batch-size", "4", "--threads", "1", "--steps", "2", "--lr",
                        "1e-2", "--save", str(tmp_path / "out"), "--server-save",
                        str(tmp_path / "ck")],
                       env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr
    saved = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    assert set(saved) == set(start)
    assert not any(torch.equal(saved[k], start[k]) for k in saved if "lora_B" in k)
    # from the adapter's values: 2 AdamW steps at lr 1e-2 move an element by about 2e-2 at
    # most (PEFT's A against l2l's seeded one: 0.2 apart)
    assert max(float((saved[k] - start[k]).abs().max()) for k in saved) < 0.06
    for f in init.iterdir():
        f.unlink()
    init.rmdir()
    [job_file] = (tmp_path / "runs").glob("*/config.json")  # (it names --lora-init too)
    for out, extra in (("again", []), ("again-config", ["--config", str(job_file)])):
        assert export_main([str(tmp_path / "ck"), str(tmp_path / out), *extra]) == 0
        again = load_file(str(tmp_path / out / "adapter_model.safetensors"))
        assert all(torch.equal(again[k], saved[k]) for k in saved)
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(path)),
                              str(tmp_path / "again"))


def test_lora_layers_adapts_the_blocks_it_names_as_peft_does(tmp_path):
    """--lora-layers 0,2 (PEFT's layers_to_transform) on a 3-block Llama: the middle block
    gets no adapter (its layer trains nothing), the adapter config says so, and 3 AdamW steps
    through the executor equal PEFT's training from the same adapter; read back with
    --lora-init, the config gives the blocks again."""
    from peft import PeftModel

    from .test_lora import _initial_adapter

    path = fx.model_dir(tmp_path / "model", "llama", num_hidden_layers=3)
    data = data_for("llama", tmp_path)
    lora = {"lora_targets": "q_proj,v_proj", "lora_layers": "0,2"}
    cfg = ModelConfig(model=f"hf:{path}", seq_len=SEQ, lora_rank=4, lora_alpha=8, **lora)
    layout = plan_layout(build_model(cfg).manifest())
    assert [p.trainable > 0 for p in layout.layers] == [False, True, False, True, False]
    got = train_local_l2l(cfg, steps=3, micro_batches=2, batch_size=4, data=data, lr=1e-2)
    init = tmp_path / "init"
    _initial_adapter(path, init, **lora)
    written = json.loads((init / "adapter_config.json").read_text())
    assert (written["layers_to_transform"], written["layers_pattern"]) == ([0, 2], "layers")
    want = _peft_names(train_hf(
        str(path), data, steps=3, micro_batches=2, batch_size=4, seq_len=SEQ, lr=1e-2,
        wrap=lambda hf: PeftModel.from_pretrained(hf, str(init), is_trainable=True)))
    adapters = {k for k in got if ".lora_" in k}
    assert adapters == {k for k in want if ".lora_" in k}
    assert len(adapters) == 8 and not any(".layers.1." in k for k in adapters)
    assert_close(got, {k: want[k] for k in got}, atol=1e-5, rtol=1e-4)
    again = ModelConfig(model=f"hf:{path}", seq_len=SEQ, lora_init=str(init))
    assert again.lora_layers == "0,2"
    with pytest.raises(ValueError, match="the model has 3 blocks"):
        build_model(dataclasses.replace(cfg, lora_layers="1-3"))
    with pytest.raises(ValueError, match="block indices and ranges"):
        ModelConfig(model=f"hf:{path}", lora_rank=4, lora_layers="2-1")


def test_lora_layers_of_a_multimodal_language_model(tmp_path):
    """A multimodal model's adapter names its language model by a pattern, which PEFT's
    layers_to_transform does not apply to: the blocks go into the pattern. PEFT adapts those
    alone, and --lora-init reads them back."""
    import transformers
    from peft import PeftModel

    path = fx.model_dir(tmp_path / "model", "gemma3-vlm")
    cfg = ModelConfig(model=f"hf:{path}", seq_len=SEQ, lora_rank=4, lora_targets="o_proj",
                      lora_layers="1")
    model = build_model(cfg)
    tensors = {(p.name, n): torch.randn_like(v) / 8 if "lora_B" in n else v
               for p in plan_layout(model.manifest()).layers
               for n, v in model.loader().load(p).items()}
    assert {layer for layer, n in tensors if ".lora_" in n} == {"blocks.1"}
    model.export(str(tmp_path / "adapter"), tensors, {})
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert r"layers\.(1)\." in config["target_modules"] and not config["layers_to_transform"]
    arch = model.source_config.architectures[0]
    adapted = PeftModel.from_pretrained(getattr(transformers, arch).from_pretrained(str(path)),
                                        str(tmp_path / "adapter"))
    adapters = {k for k in adapted.state_dict() if ".lora_A." in k}
    assert adapters and all(".language_model.layers.1." in k for k in adapters)
    again = ModelConfig(model=f"hf:{path}", seq_len=SEQ, lora_init=str(tmp_path / "adapter"))
    assert (again.lora_layers, again.lora_targets) == ("1", "o_proj")


_json = st.recursive(st.none() | st.booleans() | st.integers(-3, 70000) | st.floats(allow_nan=True)
                     | st.text(max_size=12), lambda c: st.lists(c, max_size=3)
                     | st.dictionaries(st.text(max_size=8), c, max_size=3), max_leaves=6)
_keys = st.sampled_from(["r", "lora_alpha", "target_modules", "layers_to_transform",
                         "layers_pattern", "modules_to_save", "target_parameters", "use_dora",
                         "use_rslora", "lora_dropout", "bias", "peft_type", "rank_pattern",
                         "init_lora_weights", "task_type", "alpha_pattern",
                         "exclude_modules"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(config=st.dictionaries(_keys, _json, max_size=6))
@example(config={"lora_alpha": float("nan")})
@example(config={"lora_alpha": float("inf"), "r": 4})
@example(config={"r": 2 ** 40, "lora_dropout": 1.0})
@example(config={"r": float("inf")})
@example(config={"lora_alpha": 10 ** 400, "rank_pattern": {"a{99999999999}": 2}})
@example(config={"rank_pattern": {"(?i)q_proj": 2}, "alpha_pattern": {"x": "y"}})
def test_any_adapter_config_is_taken_or_refused_with_a_reason(tmp_path, config):
    """Whatever an adapter_config.json holds, --lora-init either takes it (a rank, a finite
    positive alpha, a dropout in [0, 1)) or refuses it with a ValueError; nothing else
    escapes."""
    import math

    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    try:
        cfg = ModelConfig(model="hf:x", lora_init=str(tmp_path))
    except ValueError:
        return
    assert cfg.lora_rank >= 1 and 0 < cfg.lora_alpha < math.inf and 0 <= cfg.lora_dropout < 1


def test_per_module_ranks_alphas_and_exclusions_train_and_merge_as_peft(tmp_path):
    """--lora-rank-pattern, --lora-alpha-pattern and --lora-exclude-modules (PEFT's
    rank_pattern, alpha_pattern, exclude_modules): each module gets the first matching
    pattern's rank and alpha, an excluded one no adapter; 3 AdamW steps through the executor
    equal PEFT's training from the same adapter, --merge folds each module's own scale in, and
    --lora-init reads the options back."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from .test_lora import _initial_adapter

    path = fx.model_dir(tmp_path / "model", "llama", num_hidden_layers=3)
    data = data_for("llama", tmp_path)
    lora = {"lora_targets": "q_proj,v_proj,o_proj", "lora_rslora": True,
            # (the first pattern that matches wins, as in PEFT: block 2's q_proj 6, the others 3;
            # every o_proj alpha 3, block 1's second pattern never reached)
            "lora_rank_pattern": r"layers\.2\.self_attn\.q_proj=6,q_proj=3,v_proj=2",
            "lora_alpha_pattern": r"o_proj=3,layers\.1\.self_attn\.o_proj=5",
            "lora_exclude_modules": "layers.0.self_attn.q_proj"}
    cfg = ModelConfig(model=f"hf:{path}", seq_len=SEQ, lora_rank=4, lora_alpha=8, **lora)
    model = build_model(cfg)
    shapes = {(p.name, s.name): s.shape for p in plan_layout(model.manifest()).layers
              for s in p.tensors if "lora_A" in s.name}
    assert shapes[("blocks.2", "layer.self_attn.q_proj.lora_A.weight")][0] == 6
    assert shapes[("blocks.1", "layer.self_attn.q_proj.lora_A.weight")][0] == 3
    assert shapes[("blocks.1", "layer.self_attn.o_proj.lora_A.weight")][0] == 4
    assert shapes[("blocks.0", "layer.self_attn.v_proj.lora_A.weight")][0] == 2
    assert ("blocks.0", "layer.self_attn.q_proj.lora_A.weight") not in shapes
    assert len({k for _, k in model.layer_kinds()}) > 3  # (blocks alike share a kind)
    # (lr 1e-3: at 1e-2 one element of the rank-6 A ends 1.4e-5 from PEFT's, the others
    # within the tolerance: float noise AdamW enlarges, as test_lora.py notes for others)
    got = train_local_l2l(cfg, steps=3, micro_batches=2, batch_size=4, data=data, lr=1e-3)
    init = tmp_path / "init"
    _initial_adapter(path, init, **lora)
    written = json.loads((init / "adapter_config.json").read_text())
    assert list(written["rank_pattern"].items()) == [(r"layers\.2\.self_attn\.q_proj", 6),
                                                     ("q_proj", 3), ("v_proj", 2)]
    assert written["exclude_modules"] == ["layers.0.self_attn.q_proj"]
    want = _peft_names(train_hf(
        str(path), data, steps=3, micro_batches=2, batch_size=4, seq_len=SEQ, lr=1e-3,
        wrap=lambda hf: PeftModel.from_pretrained(hf, str(init), is_trainable=True)))
    assert {k for k in got if ".lora_" in k} == {k for k in want if ".lora_" in k}
    assert_close(got, {k: want[k] for k in got}, atol=1e-5, rtol=1e-4)
    again = ModelConfig(model=f"hf:{path}", seq_len=SEQ, lora_init=str(init))
    assert (again.lora_rank_pattern, again.lora_alpha_pattern, again.lora_exclude_modules) == (
        lora["lora_rank_pattern"], r"o_proj=3.0,layers\.1\.self_attn\.o_proj=5.0",
        "layers.0.self_attn.q_proj")
    with pytest.raises(ValueError, match="disagrees"):  # (the order decides: it must agree)
        ModelConfig(model=f"hf:{path}", seq_len=SEQ, lora_init=str(init),
                    lora_alpha_pattern=r"layers\.1\.self_attn\.o_proj=5,o_proj=3")

    tensors = {}  # B moved off zero: the merged model computes what PEFT computes
    for merge, out in ((False, "adapter"), (True, "merged")):
        m = build_model(dataclasses.replace(cfg, merge=merge))
        for plan in plan_layout(m.manifest()).layers:
            for n, v in m.loader().load(plan).items():
                tensors.setdefault((plan.name, n), torch.randn_like(v) / 8 if "lora_B" in n
                                   else v)
        m.export(str(tmp_path / out), dict(tensors), {})
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(path)),
                                        str(tmp_path / "adapter"))
    with torch.no_grad():
        torch.testing.assert_close(
            AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))(input_ids=ids).logits,
            adapted(input_ids=ids).logits, atol=1e-5, rtol=1e-4)
