"""LoRA on a Hugging Face model (--lora-rank): the base model frozen, the adapters trained as
PEFT trains them, saved as PEFT saves them (``PeftModel.from_pretrained`` loads the result)."""

from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file

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

peft = pytest.importorskip("peft")

SEQ = 16
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q_proj,v_proj"]


def _initial_adapter(path, out, classes: int = 0, **lora) -> None:
    """The adapter l2l starts from (PEFT's initialisation, seeded), written as l2l saves it."""
    model = build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ, lora_rank=4, lora_alpha=8,
                                    classes=classes, **lora))
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
    # fp32: the master, served as it is (4 B), of everything, AdamW's m, v (8 B) of the adapter
    assert eps["model_bytes"] == (4 * layout.total_numel + 8 * trained_numel
                                  + 4 * len(layout.layers))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_merge_writes_the_base_model_with_the_adapter_folded_in(tmp_path, precision):
    """--merge from an EPS checkpoint (l2l-export): W + alpha/r B A, a plain model the
    library loads, whose logits are the adapted model's; with bf16 compute too, whose EPS
    keeps the frozen base only as its bf16 copy: W is the fp32 source's, not that rounding."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = fx.model_dir(tmp_path / "model", "llama", attention_dropout=0.0)
    data = fx.lm_jsonl(tmp_path / "train.jsonl")
    p = subprocess.run([*LAUNCH, "--workers", "1", "--model", f"hf:{path}", *LORA,
                        "--data", str(data), "--seq-len", str(SEQ), "--micro-batch-size", "4",
                        "--threads", "1", "--steps", "2", "--lr", "1e-2", "--save",
                        str(tmp_path / "adapter"), "--server-save", str(tmp_path / "ck"),
                        "--precision", precision],
                       env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr
    assert export_main([str(tmp_path / "ck"), str(tmp_path / "merged"), "--merge"]) == 0
    # (a .safetensors name for an hf: model made a directory of that name; as --save, refused)
    assert export_main(["--merge", str(tmp_path / "ck"), str(tmp_path / "m.safetensors")]) == 1
    assert not (tmp_path / "m.safetensors").exists()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(path)),
                                        str(tmp_path / "adapter"))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits,
                                   adapted(input_ids=ids).logits, atol=1e-5, rtol=1e-4)


def test_an_export_writes_the_frozen_base_the_job_started_from(tmp_path):
    """With 16-bit compute the EPS keeps a frozen base only as its rounding: --merge writes
    the exact values the job started from (--init-from's here, not the checkpoint's), and
    lets go of each served copy as it replaces it (a merged base is not held twice)."""
    import weakref

    from transformers import AutoModelForCausalLM

    from protocol.safetensors_io import write_safetensors

    path = fx.model_dir(tmp_path / "model", "llama")
    cfg = ModelConfig(model=f"hf:{path}", seq_len=SEQ, lora_rank=4, lora_alpha=8, merge=True)
    model, start = build_model(cfg), {}
    for plan in plan_layout(model.manifest()).layers:
        frozen = {s.name for s in plan.tensors if s.group == "frozen"}
        start.update({(plan.name, n): v * 1.01 if n in frozen else v
                      for n, v in model.loader().load(plan).items()})
    write_safetensors(str(tmp_path / "init.safetensors"),
                      [(f"{layer}.{n}", v) for (layer, n), v in start.items()])
    model = build_model(dataclasses.replace(cfg, init_from=str(tmp_path / "init.safetensors")))
    frozen = {(p.name, s.name) for p in plan_layout(model.manifest()).layers
              for s in p.tensors if s.group == "frozen"}
    tensors = {k: v.bfloat16().float() if k in frozen else v for k, v in start.items()}
    served = [weakref.ref(tensors[k]) for k in frozen]
    assert any(not torch.equal(tensors[k], start[k]) for k in frozen)
    model.export(str(tmp_path / "merged"), tensors, {})
    assert not any(ref() for ref in served)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).state_dict()
    names = {model.family.hf_name(layer, n): (layer, n) for layer, n in frozen}
    assert all(torch.equal(merged[k], start[names[k]]) for k in names if k in merged)
    assert len([k for k in names if k in merged]) >= len(frozen) - 1  # (a tied head, once)


def _peft_names(state: dict) -> dict:
    """A PEFT model's state dict under the library model's names (its wrappers' parts
    dropped: the trained copy of a module to save stands for the module)."""
    drop = ("base_model.model.", ".default", ".modules_to_save", ".base_layer")
    out = {}
    for k, v in state.items():
        if "original_module" not in k:
            for d in drop:
                k = k.replace(d, "")
            out[k.replace(".lora_magnitude_vector.weight", ".lora_magnitude_vector")] = v
    return out


@pytest.mark.parametrize("family, classes, lora", [
    ("gpt2", 0, {}), ("gpt2", 0, {"lora_dora": True, "lora_dropout": 0.1}),
    ("bert-base", 3, {"lora_rslora": True, "lora_dora": True})],
    ids=["gpt2", "gpt2-dora-dropout", "bert-base-rslora-dora"])
def test_lora_of_conv1d_and_of_a_new_classifier_trains_as_peft(tmp_path, family, classes, lora):
    """GPT-2's Conv1D c_attn (PEFT's default target for it: fan_in_fan_out), plain and with
    DoRA and dropout on the adapters' input, and a BERT base model with a new 3-way head, which
    trains whole beside the adapters on query and value (PEFT's SEQ_CLS defaults), its adapters
    rank-stabilised (alpha / sqrt(r)) DoRA: 3 AdamW steps with dropout 0.1 through the L2L
    executor equal PEFT's training of the library model from the same start (FP32, 1e-5 +
    1e-4 rel); the adapter config says what PEFT needs to read them."""
    from peft import PeftModel

    path = fx.model_dir(tmp_path / "model", family, biases=True)  # (DoRA's base output less b)
    data = data_for(family, tmp_path, classes=classes)
    cfg = ModelConfig(model=f"hf:{path}", seq_len=SEQ, classes=classes, lora_rank=4,
                      lora_alpha=8, **lora)
    got = train_local_l2l(cfg, steps=3, micro_batches=2, batch_size=4, data=data, lr=1e-2)
    init = tmp_path / "init"
    _initial_adapter(path, init, classes=classes, **lora)
    config = json.loads((init / "adapter_config.json").read_text())
    assert config["use_rslora"] is lora.get("lora_rslora", False)
    assert config["use_dora"] is lora.get("lora_dora", False)
    assert config["lora_dropout"] == lora.get("lora_dropout", 0.0)
    start = load_file(str(init / "adapter_model.safetensors"))
    if classes:
        assert config["target_modules"] == ["query", "value"]
        assert config["modules_to_save"] == ["classifier", "score"]
        assert "base_model.model.classifier.weight" in start
    else:
        assert config["target_modules"] == ["c_attn"] and config["fan_in_fan_out"]
    if lora.get("lora_dora"):  # DoRA's magnitudes start where PEFT's own start
        import transformers
        from peft import LoraConfig, get_peft_model

        auto = (transformers.AutoModelForSequenceClassification if classes else
                transformers.AutoModelForCausalLM)
        own = _peft_names(get_peft_model(auto.from_pretrained(
            str(path), **({"num_labels": classes} if classes else {})),
            LoraConfig.from_pretrained(str(init))).state_dict())
        magnitudes = [k for k in own if k.endswith(".lora_magnitude_vector")]
        assert magnitudes
        assert_close({k: start[f"base_model.model.{k}"] for k in magnitudes},
                      {k: own[k] for k in magnitudes}, atol=1e-6, rtol=1e-6)
    want = _peft_names(train_hf(
        str(path), data, steps=3, micro_batches=2, batch_size=4, seq_len=SEQ, lr=1e-2,
        classes=classes, wrap=lambda hf: PeftModel.from_pretrained(hf, str(init),
                                                                   is_trainable=True)))
    assert_close(got, {k: want[k] for k in got}, atol=1e-5, rtol=1e-4)
    trained = [k.removeprefix("base_model.model.") for k in start]
    assert not any(torch.equal(got[k], start[f"base_model.model.{k}"]) for k in trained
                   if "lora_A" not in k)  # every B (magnitude) and the head moved
    assert any(".lora_magnitude_vector" in k for k in got) is lora.get("lora_dora", False)


# lr 1e-3 on Qwen3-Next: at 1e-2 one element of in_proj_qkvz's A ends 3e-4 apart (step 1
# exact). Its first non-zero gradient (step 2, B having moved once) is ~4e-8, so AdamW's first
# update, about lr g / (|g| + eps), turns a few % of float noise in g into a few % of lr.
@pytest.mark.parametrize("family, targets, modules, lr", [
    ("qwen2_moe", "all-linear", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                 "up_proj", "down_proj", "shared_expert_gate"], 1e-2),
    ("qwen3_next", "q_proj,v_proj,in_proj_qkvz,out_proj,shared_expert_gate",
     ["q_proj", "v_proj", "in_proj_qkvz", "out_proj", "shared_expert_gate"], 1e-3),
    ("qwen3_next", "q_proj,v_proj", ["q_proj", "v_proj"], 1e-3),
    ("granitemoehybrid", "all-linear", ["in_proj", "out_proj", "q_proj", "k_proj", "v_proj",
                                        "o_proj", "input_linear", "output_linear"], 1e-3),
    ("deepseek_v32", "q_a_proj,o_proj,wk,wq_b", ["q_a_proj", "o_proj"], 1e-3)])
def test_lora_of_a_mixture_of_experts_trains_as_peft(tmp_path, family, targets, modules, lr):
    """all-linear on Qwen2-MoE adapts what PEFT's all-linear adapts: the attention, the shared
    expert and its gate (Linear layers), not the router nor the stacked experts. On Qwen3-Next
    the linear attention's projections too, and q_proj,v_proj adapts its full-attention layer
    alone (the linear one has none). (PEFT reads gate_proj, up_proj or down_proj of Qwen3-Next
    as its experts too, converting them from transformers 4: not compared.) Granite 4.0-H's
    Mamba-2 projections and shared MLP too; DeepSeek-V3.2's indexer, which never trains, gets
    no adapter (wk, wq_b). 3 AdamW steps through the executor equal PEFT's training from the
    same adapter."""
    from peft import PeftModel

    path = fx.model_dir(tmp_path / "model", family)
    data = data_for(family, tmp_path)
    lora = {"lora_targets": targets}
    cfg = ModelConfig(model=f"hf:{path}", seq_len=SEQ, lora_rank=4, lora_alpha=8, **lora)
    got = train_local_l2l(cfg, steps=3, micro_batches=2, batch_size=4, data=data, lr=lr)
    init = tmp_path / "init"
    _initial_adapter(path, init, **lora)
    config = json.loads((init / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(modules)
    want = _peft_names(train_hf(
        str(path), data, steps=3, micro_batches=2, batch_size=4, seq_len=SEQ, lr=lr,
        wrap=lambda hf: PeftModel.from_pretrained(hf, str(init), is_trainable=True)))
    adapters = [k for k in want if "lora_" in k]
    assert adapters and set(adapters) == {k for k in got if "lora_" in k}
    assert not any("experts." in k or "mlp.gate." in k for k in adapters)
    assert_close(got, {k: want[k] for k in got}, atol=1e-5, rtol=1e-4)

@pytest.mark.parametrize("family, lora", [
    ("olmoe", {"lora_target_parameters": "gate_up_proj,down_proj"}),
    ("mixtral", {"lora_target_parameters": "mlp.experts.down_proj", "lora_rslora": True}),
    ("qwen2_moe", {"lora_target_parameters": "gate_up_proj", "lora_targets": "none"}),
    ("gpt_oss", {"lora_target_parameters": "gate_up_proj,down_proj"}),
    ("llama4_text", {"lora_target_parameters": "gate_up_proj,down_proj"})],
    ids=["olmoe-both", "mixtral-down-rslora", "qwen2_moe-gate_up-alone", "gpt_oss-transposed",
         "llama4"])
def test_lora_of_the_stacked_experts_trains_and_merges_as_peft(tmp_path, family, lora):
    """PEFT's target_parameters: every expert of a stack gets its own rank-r adapter (A: r*E x
    in, B: out x r*E, expert e's rows and columns as PEFT reshapes them; gpt-oss's stacks are
    in x out; two adapted stacks of a module nest as PEFT nests them). 3 AdamW steps through
    the executor (with the attention's adapters, but where none are asked for) equal PEFT's
    training from the same adapter, which PEFT loads; --merge folds each expert's update into
    its own Linear of the checkpoint (gpt-oss: its stack), and the merged model computes what
    PEFT computes with the adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = fx.model_dir(tmp_path / "model", family)
    data = data_for(family, tmp_path)
    cfg = ModelConfig(model=f"hf:{path}", seq_len=SEQ, lora_rank=4, lora_alpha=8, **lora)
    # lr 1e-3: at 1e-2 a few elements of an expert's A, whose gradients of steps 2 and 3
    # nearly cancel in AdamW's moments, turn float-level differences into 1e-5 (PEFT against
    # itself with the eager experts: 1e-6); at 1e-3 all are within 5e-8
    got = {k: v for k, v in train_local_l2l(cfg, steps=3, micro_batches=2, batch_size=4,
                                            data=data, lr=1e-3).items() if ".lora_" in k}
    init = tmp_path / "init"
    _initial_adapter(path, init, **lora)
    config = json.loads((init / "adapter_config.json").read_text())
    asked = lora["lora_target_parameters"].split(",")
    assert config["target_parameters"] == sorted(asked)
    trained = train_hf(str(path), data, steps=3, micro_batches=2, batch_size=4, seq_len=SEQ,
                       lr=1e-3, wrap=lambda hf: PeftModel.from_pretrained(hf, str(init),
                                                                          is_trainable=True))
    want = {k.replace("base_model.model.", "").replace(".default", ""): v
            for k, v in trained.items() if ".lora_" in k}
    assert set(got) == set(want)
    experts = [k for k in got if ".experts." in k]
    assert len(experts) == 2 * len(asked) * sum(".experts.lora_A" in k for k in got)
    assert ("lora_targets" in lora) is not any("self_attn" in k for k in got)
    assert_close(got, want, atol=1e-5, rtol=1e-4)
    start = load_file(str(init / "adapter_model.safetensors"))
    assert not any(torch.equal(v, start[f"base_model.model.{k}"]) for k, v in got.items()
                   if "lora_B" in k)  # every expert stack's B moved

    model = build_model(cfg)
    model.assemble()  # (the resident baselines build it: a stack's attribute is a property)
    names = {model.family.hf_name(p.name, t.name): (p.name, t.name)
             for p in plan_layout(model.manifest()).layers for t in p.tensors}
    tensors = {(p.name, n): v for p in plan_layout(model.manifest()).layers
               for n, v in model.loader().load(p).items()}
    tensors.update({names[k]: v for k, v in got.items()})
    model.export(str(tmp_path / "adapter"), tensors, {})
    build_model(dataclasses.replace(cfg, merge=True)).export(
        str(tmp_path / "merged"), tensors, {})
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(path)),
                                        str(tmp_path / "adapter")).eval()
    loaded = {k.replace("base_model.model.", "").replace(".default", ""): v
              for k, v in adapted.state_dict().items() if ".lora_" in k}
    assert all(torch.equal(loaded[k], v) for k, v in got.items())
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(str(path)).eval()(input_ids=ids).logits
        want = adapted(input_ids=ids).logits
        assert not torch.allclose(want, plain, atol=1e-4)
        torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family, lora", [
    ("llama", {"lora_rslora": True}), ("gpt2", {}), ("llama", {"lora_dora": True}),
    ("gpt2", {"lora_dora": True, "lora_rslora": True}), ("phi", {}), ("gpt_neox", {})],
    ids=["llama-rslora", "gpt2", "llama-dora", "gpt2-dora-rslora", "phi", "gpt_neox"])
def test_a_merged_model_computes_what_peft_computes_with_the_adapter(tmp_path, family, lora):
    """--merge folds the adapter in (W + alpha/r B A, rank-stabilised: alpha/sqrt(r); DoRA:
    scaled by m / ||W + alpha/r B A|| by row; a Conv1D weight, in x out, takes the transpose):
    the merged model's logits are PEFT's with the adapter l2l saves."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = fx.model_dir(tmp_path / "model", family)
    tensors = {}
    for merge, out in ((False, "adapter"), (True, "merged")):
        model = build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ, lora_rank=4,
                                        lora_alpha=8, lora_targets="all-linear", merge=merge,
                                        **lora))
        for plan in plan_layout(model.manifest()).layers:
            values = model.loader().load(plan)
            for n, v in values.items():  # B is zero at the start, m W's norm: move them
                tensors.setdefault((plan.name, n), torch.randn_like(v) / 8 if "lora_B" in n
                                   else v * (1 + torch.rand_like(v)) if "magnitude" in n
                                   else v)
        model.export(str(tmp_path / out), tensors, {})
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(path)),
                                        str(tmp_path / "adapter"))
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(str(path))(input_ids=ids).logits
        want = adapted(input_ids=ids).logits
        assert not torch.allclose(want, plain, atol=1e-3)
        torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-5, rtol=1e-4)


def test_lora_trains_a_new_classifier_head_whole_unless_told_not_to(tmp_path):
    """A causal LM given --classes gets a new head, trained whole beside the adapters (PEFT's
    SEQ_CLS: modules_to_save); with --lora-modules-to-save none it would never leave its random
    start and is refused; a module name that matches nothing is refused; names match as PEFT
    matches them (a module whose name ends with one); a module LoRA adapts, or one holding
    such, is refused (PEFT would not adapt it), and so is a tied embedding (PEFT's adapter would
    load it apart from the LM head that reads it)."""
    path = fx.model_dir(tmp_path / "model", "llama")

    def trained(model_dir, **kw):
        manifest = build_model(ModelConfig(model=f"hf:{model_dir}", seq_len=SEQ, lora_rank=4,
                                           **kw)).manifest()
        return {t.name for la in manifest.layers for t in la.tensors if t.group != "frozen"}

    names = trained(path, classes=3)
    assert "score.weight" in names and all(".lora_" in n for n in names - {"score.weight"})
    with pytest.raises(ValueError, match="leaves the new classifier head"):
        build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ, classes=3, lora_rank=4,
                                lora_modules_to_save="none"))
    with pytest.raises(ValueError, match="'embed' matches no module"):
        trained(path, lora_modules_to_save="embed")
    assert "embed_tokens.weight" in trained(path, lora_modules_to_save="embed_tokens")
    norms = {n for n in trained(path, lora_modules_to_save="norm") if ".lora_" not in n}
    assert norms == {"layer.input_layernorm.weight", "layer.post_attention_layernorm.weight",
                     "norm.weight"}, norms
    for inside in ("q_proj", "self_attn", "proj"):  # a module adapted, or holding one
        with pytest.raises(ValueError, match="which --lora-targets adapts"):
            trained(path, lora_modules_to_save=inside)
    tied = fx.model_dir(tmp_path / "tied", "qwen2")
    with pytest.raises(ValueError, match="tied embeddings"):
        trained(tied, lora_modules_to_save="embed_tokens")
    cls = fx.model_dir(tmp_path / "cls", "llama-cls")  # its own head: frozen when told
    names = trained(cls, lora_modules_to_save="none")
    assert names and all(".lora_" in n for n in names)


@pytest.mark.parametrize("option", ["lora_rslora", "lora_dora", "merge"])
def test_the_adapters_options_need_an_adapter(option):
    with pytest.raises(ValueError, match="give --lora-rank"):
        ModelConfig(model="hf:x", **{option: True})


def test_expert_adapters_are_refused_where_peft_refuses_them(tmp_path):
    """--lora-target-parameters needs an adapter, takes neither dropout nor DoRA (PEFT's
    ParamWrapper refuses both), and must match a stack of experts: nothing on a dense model,
    a 2-D weight (a Linear: --lora-targets) neither."""
    with pytest.raises(ValueError, match="give --lora-rank"):
        ModelConfig(model="hf:x", lora_target_parameters="down_proj")
    for option in ({"lora_dropout": 0.1}, {"lora_dora": True}):
        with pytest.raises(ValueError, match="PEFT's target_parameters refuses them"):
            ModelConfig(model="hf:x", lora_rank=4, lora_target_parameters="down_proj", **option)
    llama = fx.model_dir(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match="matches no parameter"):
        build_model(ModelConfig(model=f"hf:{llama}", lora_rank=4,
                                lora_target_parameters="gate_up_proj")).manifest()
    with pytest.raises(ValueError, match="not a stack of experts"):
        build_model(ModelConfig(model=f"hf:{llama}", lora_rank=4,
                                lora_target_parameters="down_proj.weight")).manifest()


def test_targets_outside_the_blocks_are_refused_or_said(tmp_path, caplog):
    """PEFT adapts an embedding or an LM head named in target_modules; l2l adapts the blocks'
    linear layers, and dropped such a name without a word (the adapter trained less than the
    user asked for). A name only outside the blocks is refused; one that also names the
    blocks' modules (BERT's dense: its pooler's too) is said."""
    llama = fx.model_dir(tmp_path / "llama", "llama")
    for name in ("embed_tokens", "lm_head"):
        with pytest.raises(ValueError, match=f"--lora-targets {name}: the model's {name}, "
                           f"outside its blocks.* --lora-modules-to-save {name} trains it"):
            build_model(ModelConfig(model=f"hf:{llama}", seq_len=SEQ, lora_rank=4,
                                    lora_targets=f"q_proj,{name}")).manifest()
    bert = fx.model_dir(tmp_path / "bert", "bert")
    build_model(ModelConfig(model=f"hf:{bert}", seq_len=SEQ, lora_rank=4,
                            lora_targets="query,dense")).manifest()
    assert "also names pooler.dense outside the blocks" in caplog.text


def test_moe_mlp_targets_that_peft_would_load_as_experts_are_refused(tmp_path):
    """PEFT converts a DeepSeek-V3 (Qwen2-MoE-like) adapter's gate_proj/up_proj/down_proj
    into the experts' stacked parameters as it loads it: the adapters trained on the dense
    layer's and the shared experts' MLPs were dropped, and the experts got fresh ones. Such
    targets are refused; attention targets are taken."""
    pytest.importorskip("peft.utils.transformers_weight_conversion")
    path = fx.model_dir(tmp_path / "ds", "deepseek_v3")
    for targets in ("all-linear", "q_a_proj,gate_proj,up_proj,down_proj"):
        with pytest.raises(ValueError, match="adapts the linear layers down_proj, gate_proj, "
                           "up_proj .* PEFT loads those names of a deepseek_v3 adapter as its "
                           "experts' stacked parameters"):
            build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ, lora_rank=4,
                                    lora_targets=targets)).manifest()
    build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ, lora_rank=4,
                            lora_targets="q_a_proj,o_proj")).manifest()


@pytest.mark.parametrize("served", [torch.float32, torch.bfloat16])
def test_a_dora_layer_starts_as_its_base_layer_in_the_dtype_it_is_served_in(served):
    """B is zero at the start and DoRA's magnitude the norm of W's rows as the worker holds W
    (in bf16 with bf16 compute, as PEFT takes it from the bf16 weight): the adapted layer's
    output is the base layer's, bit for bit (a magnitude from the fp32 weight, rounded to bf16,
    would be off by 2^-8 of a row's output in about one row in 60)."""
    from torch import nn

    from protocol.tensors import LayerSpec, Manifest, TensorSpec
    from worker.models import lora

    torch.manual_seed(0)
    block = nn.Module()
    block.q_proj = nn.Linear(256, 192)
    base = {n: p.detach().clone() for n, p in block.named_parameters()}
    lora.apply(block, 4, lora.scaling(8, 4), "q_proj", 0.0, dora=True)
    plan = plan_layout(Manifest(layers=(LayerSpec(name="l", kind="block", tensors=tuple(
        TensorSpec(name=n, shape=tuple(p.shape)) for n, p in block.named_parameters())),))
                       ).layers[0]

    class Checkpoint:
        def load(self, plan):
            return {s.name: base[s.name] for s in plan.tensors}

    init = lora.LoraInit(Checkpoint(), seed=0)
    init.served = served
    values = init.load(plan)
    block.to(served)
    with torch.no_grad():
        for n, p in block.named_parameters():
            p.copy_(values[n])
    x = torch.randn(8, 256, dtype=served)
    with torch.no_grad():
        assert torch.equal(block.q_proj(x), nn.functional.linear(
            x, base["q_proj.weight"].to(served), base["q_proj.bias"].to(served)))


def test_auto_targets_are_pefts_defaults():
    """--lora-targets auto: PEFT's default targets (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_
    MAPPING) for every supported model type PEFT has them for."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as peft

    from worker.models import lora
    from worker.models.hf import families

    known = [t for t in families.FAMILIES if t in peft]
    assert {"phi", "llama", "gpt_neox"} <= set(known)
    for t in known:
        assert set(lora.targets("auto", t)) == set(peft[t]), t
