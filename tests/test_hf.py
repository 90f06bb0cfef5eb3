"""Hugging Face models (--model hf:DIR) against the library's own models: tiny BERT, GPT-2,
Llama-style and mixture-of-experts directories made by save_pretrained in a temporary directory.

L2L (the executor, weights held locally: tests.baseline.train_local_l2l) trains them exactly
as the library's model trains itself (all layers resident, torch AdamW, gradient accumulation
over the same micro-batches, each layer's dropout seeded alike, padding in the batches): within
1e-5 absolute + 1e-4 relative after 3 steps. The process-level runs are in test_hf_jobs.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

from worker.config import DataConfig, ModelConfig
from worker.data import build_task
from worker.models import build_model
from worker.models.hf import families

from . import hf_fixtures as fx
from .baseline import assert_close, train_local_l2l
from .hf_baseline import train_hf

transformers = pytest.importorskip("transformers")

SEQ = 16


def data_for(family: str, tmp_path, pairs: bool = False, classes: int = 0) -> DataConfig:
    if family in fx.ENCODERS or family.endswith("-cls") or classes:
        tsv = fx.classification_tsv(tmp_path / "train.tsv", pairs=pairs)
        return DataConfig(data=str(tsv), text_column="sentence1" if pairs else "sentence",
                          text_pair_column="sentence2" if pairs else "")
    if family in ("qwen2", "qwen3_5_moe_text", "qwen3_5-vlm", "deepseek_v32"):  # (their
        # tokenizer classes: not the fixture's word vocabulary; DeepSeek-V3.2: no padding, so
        # that its mask is one SDPA could skip)
        return DataConfig(data=str(fx.tokens_bin(tmp_path / "train.bin")))
    return DataConfig(data=str(fx.lm_jsonl(tmp_path / "train.jsonl")))


@pytest.mark.parametrize("family, pairs, classes", [
    ("bert", True, 0), ("bert-mlm", False, 3), ("roberta", False, 0), ("roberta-mlm", False, 3),
    ("xlm-roberta", False, 0),
    ("gpt2", False, 0), *((f, False, 0) for f in fx.DECODERS), ("qwen3-cls", False, 0),
    ("qwen3_next-cls", False, 0),
    ("mixtral-cls", False, 0), ("nemotron-cls", False, 0), ("phi-cls", False, 0),
    ("gpt_neox-cls", False, 0),
    ("llama", False, 3)])
def test_l2l_trains_the_library_model_exactly(tmp_path, family, pairs, classes):
    """BERT classifier on sentence pairs (token types), and from a masked LM (a new pooler and
    head); RoBERTa (positions from the padding,
    a first-token head) from a classifier and, with a new head (``classes``), from a masked LM;
    GPT-2 with its tied LM head; the decoders of fx.DECODERS (grouped-query attention, windows
    shorter than the sequence, layers without rotary, scaled embeddings and logits, tied heads,
    mixtures of experts with router noise, shared experts and dense layers, linear attention)
    on text or token ids; decoders (Qwen3, Qwen3-Next, Mixtral) as sequence classifiers
    (pooled at the last real token of padded rows), from a classifier and from a causal LM
    with a new head; dropout 0.1 everywhere it exists. A tensor the library's training leaves
    exactly where it was (no gradient ever reaches it) is left there too."""
    path = fx.model_dir(tmp_path / "model", family)
    data = data_for(family, tmp_path, pairs, classes)
    got = train_local_l2l(ModelConfig(model=f"hf:{path}", seq_len=SEQ, classes=classes),
                          steps=3, micro_batches=2, batch_size=4, data=data)
    want = train_hf(str(path), data, steps=3, micro_batches=2, batch_size=4, seq_len=SEQ,
                    classes=classes)
    assert_close(got, {k: v for k, v in want.items() if k in got})
    start = train_hf(str(path), data, steps=0, micro_batches=2, batch_size=4, seq_len=SEQ,
                     classes=classes)  # what the library never moves (no gradient: AdamW
    moved = [k for k in got if torch.equal(want[k], start[k]) and not torch.equal(  # skips it)
        got[k], start[k])]  # is not moved here either (weight decay alone would move it)
    assert not moved, moved
    tied = build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ, classes=classes)).ties()
    if tied:  # one stored tensor
        assert "lm_head.weight" not in got and "lm_head.weight" in want


def test_padding_is_present(tmp_path):
    """The batches of these tests are padded: masks matter."""
    path = fx.model_dir(tmp_path / "model", "gpt2")
    task = build_task(build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ)),
                      data_for("gpt2", tmp_path), micro_batch_size=4, global_micro_batches=2)
    b = task.micro_batch(0, 0, 4, 1.0)
    assert b.mask is not None and (b.mask == 0).any() and (b.targets == -100).any()


def test_a_base_model_checkpoint_gets_a_new_classifier(tmp_path):
    """A plain BertModel checkpoint trains as a classifier of --classes labels: the head is
    initialised fresh, everything else comes from the checkpoint."""
    path = fx.model_dir(tmp_path / "base", "bert-base")
    model = build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ, classes=5))
    from protocol.tensors import plan_layout

    plans = plan_layout(model.manifest()).layers
    head = model.loader().load(plans[-1])
    assert head["classifier.weight"].shape == (5, 32)
    base = transformers.BertModel.from_pretrained(str(path))
    emb = model.loader().load(plans[0])
    assert torch.equal(emb["embeddings.word_embeddings.weight"],
                       base.embeddings.word_embeddings.weight)


def test_a_checkpoint_of_another_head_gives_its_base_model_only(tmp_path, caplog):
    """A token classifier's head has a sequence classifier's names and shapes but is not one:
    it is not read (a new head is initialised), and a decoder's token classifier trains as a
    causal LM (the warning says what it trains); without --classes a non-classifier BERT is refused,
    naming its class."""
    import transformers as tf

    from protocol.tensors import plan_layout

    bert = tmp_path / "bert-tok"
    tf.BertForTokenClassification(tf.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, num_labels=3)).save_pretrained(bert)
    fx.tokenizer(bert, "bert")
    with pytest.raises(ValueError, match="BertForTokenClassification, not a sequence "
                                         "classifier.*give --classes"):
        build_model(ModelConfig(model=f"hf:{bert}", seq_len=SEQ))
    model = build_model(ModelConfig(model=f"hf:{bert}", seq_len=SEQ, classes=3))
    assert "trained as a BertForSequenceClassification" in caplog.text
    plans = plan_layout(model.manifest()).layers
    ref = tf.BertForTokenClassification.from_pretrained(str(bert))
    head = model.loader().load(plans[-1])
    assert head["classifier.weight"].shape == ref.classifier.weight.shape
    assert not torch.equal(head["classifier.weight"], ref.classifier.weight)
    assert torch.equal(model.loader().load(plans[1])["layer.attention.self.query.weight"],
                       ref.bert.encoder.layer[0].attention.self.query.weight)

    llama = fx.model_dir(tmp_path / "llama", "llama")
    cfg = tf.AutoConfig.from_pretrained(llama)
    tf.LlamaForTokenClassification(cfg).save_pretrained(llama)
    caplog.clear()
    assert build_model(ModelConfig(model=f"hf:{llama}", seq_len=SEQ)).objective == "lm"
    assert "is a LlamaForTokenClassification: trained as a LlamaForCausalLM" in caplog.text


def test_a_missing_model_directory_is_named(tmp_path):
    with pytest.raises(ValueError, match="no such directory"):
        build_model(ModelConfig(model=f"hf:{tmp_path / 'nothing'}"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        build_model(ModelConfig(model=f"hf:{tmp_path / 'empty'}"))


def test_export_loads_with_from_pretrained(tmp_path):
    """hf -> l2l -> hf with zero steps is bitwise identical; after training, the exported
    directory's logits equal those of the trained weights."""
    path = fx.model_dir(tmp_path / "model", "gpt2")
    model = build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ))
    from protocol.tensors import plan_layout

    layout = plan_layout(model.manifest())
    initial = {(p.name, n): t for p in layout.layers
               for n, t in model.loader().load(p).items()}
    model.export(str(tmp_path / "out0"), initial, {})
    a = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    b = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out0"))
    assert set(a.state_dict()) == set(b.state_dict())
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    assert (tmp_path / "out0" / "tokenizer.json").exists()
    assert (tmp_path / "out0" / "generation_config.json").read_text() == \
        (path / "generation_config.json").read_text()  # a chat model's end-of-turn ids
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out0"))("good movie")

    data = data_for("gpt2", tmp_path)
    got = train_local_l2l(ModelConfig(model=f"hf:{path}", seq_len=SEQ), steps=2,
                          micro_batches=2, batch_size=4, data=data)
    names = {model.family.hf_name(p.name, s.name): (p.name, s.name)
             for p in layout.layers for s in p.tensors}
    model.export(str(tmp_path / "out"), {names[k]: v for k, v in got.items()}, {})
    trained = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    reference.load_state_dict({**reference.state_dict(), **got, "lm_head.weight":
                               got["transformer.wte.weight"]})
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        assert torch.allclose(trained(ids).logits, reference(ids).logits, atol=1e-5)
        assert not torch.allclose(trained(ids).logits, a.eval()(ids).logits, atol=1e-5)


@pytest.mark.parametrize("family, classes", [
    ("roberta-mlm", 3), ("xlm-roberta", 0), ("smollm3", 0), ("gemma", 0), ("granite", 0),
    ("qwen3-cls", 0), ("llama", 3), ("gemma3_text", 3)])
def test_every_family_exports_what_it_loaded(tmp_path, family, classes):
    """Export of the initial weights (a masked LM's or a causal LM's as a classifier with its
    new head) names every tensor as the library does: from_pretrained of the class the config
    names loads them all (none missing, none left over) to the same values; a decoder
    classifier's config names the padding it pools by."""
    from protocol.tensors import plan_layout

    path = fx.model_dir(tmp_path / "model", family)
    model = build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ, classes=classes))
    initial = {(p.name, n): t for p in plan_layout(model.manifest()).layers
               for n, t in model.loader().load(p).items()}
    model.export(str(tmp_path / "out"), initial, {})
    config = transformers.AutoConfig.from_pretrained(str(tmp_path / "out"))
    assert config.architectures == [families.hf_class(model.config, model.family)]
    loaded = getattr(transformers, config.architectures[0]).from_pretrained(
        str(tmp_path / "out"), output_loading_info=True)
    hf, info = loaded
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    state = hf.state_dict()
    for (layer, name), t in initial.items():
        assert torch.equal(state[model.family.hf_name(layer, name)], t), (layer, name)
    if family in ("qwen3-cls", "llama"):
        assert config.pad_token_id == 0 and config.num_labels == 3  # the fixture's [PAD]



def test_a_bf16_export_keeps_what_the_library_keeps_in_fp32(tmp_path):
    """DeepSeek-V3's router weight and routing bias (``_keep_in_fp32_modules_strict``):
    from_pretrained in bf16 keeps them fp32, and so does save_pretrained; --save-dtype bf16
    writes every tensor in the dtype save_pretrained writes it, the shard index's total size
    too, and the bias and router weight unrounded. The bias, frozen, comes as a job with bf16
    compute has it, its bf16 copy: the export writes the source's fp32 value (without the
    source's weights, the value as served)."""
    import json

    from protocol.safetensors_io import SafetensorsFile
    from protocol.tensors import plan_layout
    from worker.models.hf import shards

    path = fx.model_dir(tmp_path / "model", "deepseek_v3", biases=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16)
    hf.save_pretrained(str(tmp_path / "hf"), max_shard_size="20KB")
    model = build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ, save_dtype="bf16",
                                    save_max_shard_size="20KB"))
    gen = torch.Generator().manual_seed(0)
    source = {(p.name, n): t for p in plan_layout(model.manifest()).layers
              for n, t in model.loader().load(p).items()}
    trained = {k: t + 1e-3 * torch.randn(t.shape, generator=gen) for k, t in source.items()}
    bias = [k for k in source if k[1].endswith("e_score_correction_bias")]
    assert bias and not torch.equal(source[bias[0]].bfloat16().float(), source[bias[0]])
    model.export(str(tmp_path / "out"), {**trained, **{
        k: source[k].bfloat16().float() for k in bias}}, {})
    trained.update({k: source[k] for k in bias})

    def dtypes(root):
        index = json.loads((root / shards.INDEX).read_text())
        return index["metadata"]["total_size"], {
            name: SafetensorsFile(str(root / file)).get(name).dtype
            for name, file in index["weight_map"].items()}

    size, ours = dtypes(tmp_path / "out")
    assert (size, ours) == dtypes(tmp_path / "hf")
    kept = {n for n, d in ours.items() if d == torch.float32}
    assert kept and all(n.endswith(("gate.weight", "e_score_correction_bias")) for n in kept)
    assert any(n.endswith("e_score_correction_bias") for n in kept)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"),
                                                               dtype="auto").state_dict()
    for (layer, name), t in trained.items():
        key = model.family.hf_name(layer, name)
        want = t if key in kept else t.bfloat16()
        if key in loaded:  # (experts: one tensor each in the files, stacked when loaded)
            assert torch.equal(loaded[key], want), key

    (path / "model.safetensors").unlink()  # the source's weights gone: written as served
    model.export(str(tmp_path / "again"), {**trained, **{
        k: source[k].bfloat16().float() for k in bias}}, {})
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "again"),
                                                              dtype="auto").state_dict()
    key = model.family.hf_name(*bias[0])
    assert torch.equal(again[key], source[bias[0]].bfloat16().float())


@pytest.mark.parametrize("family", ["gpt_neox", "gpt_neox-cls", "phi"])
def test_an_export_writes_the_names_save_pretrained_writes(tmp_path, family):
    """GPT-NeoX's LM head, lm_head in the library, is saved as embed_out; Phi's final norm is
    final_layernorm: an export writes the source's names, which from_pretrained reads back."""
    from protocol.safetensors_io import SafetensorsFile
    from protocol.tensors import plan_layout

    path = fx.model_dir(tmp_path / "model", family)
    model = build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ))
    tensors = {(p.name, n): t for p in plan_layout(model.manifest()).layers
               for n, t in model.loader().load(p).items()}
    model.export(str(tmp_path / "out"), tensors, {})
    names = set(SafetensorsFile(str(tmp_path / "out" / "model.safetensors")).keys())
    assert names == set(SafetensorsFile(str(path / "model.safetensors")).keys())
    assert ("embed_out.weight" in names) is (family == "gpt_neox")
    cls = getattr(transformers, model.export_config().architectures[0])
    want, got = (cls.from_pretrained(str(p)).state_dict() for p in (path, tmp_path / "out"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("family, sub", [
    ("qwen3_moe", "Qwen3MoeModel"), ("qwen3_5-vlm", "Qwen3_5TextModel")])
def test_a_bf16_export_keeps_what_a_sub_model_keeps_in_fp32(tmp_path, monkeypatch, family, sub):
    """The library gathers the fp32-kept modules of the models a class holds (its base model,
    a multimodal model's language model): a bf16 export writes each tensor in the dtype
    save_pretrained writes it. A vision tower's tensors, from the bf16 source, come out fp32
    where kept."""
    from protocol.safetensors_io import SafetensorsFile
    from protocol.tensors import plan_layout

    monkeypatch.setattr(getattr(transformers, sub), "_keep_in_fp32_modules_strict",
                        ["input_layernorm", "patch_embed"])
    path = fx.model_dir(tmp_path / "model", family)
    cls = getattr(transformers, {**fx.DECODERS, **fx.MULTIMODAL}[family][1])
    hf = cls.from_pretrained(str(path), dtype=torch.bfloat16)
    hf.save_pretrained(str(tmp_path / "hf"))
    if family.endswith("-vlm"):  # (a bf16 source: the vision tower is copied from it)
        cls.from_pretrained(str(path)).to(torch.bfloat16).save_pretrained(str(path))
    model = build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ, save_dtype="bf16"))
    tensors = {(p.name, n): t for p in plan_layout(model.manifest()).layers
               for n, t in model.loader().load(p).items()}
    model.export(str(tmp_path / "out"), tensors, {})

    def dtypes(root):
        f = SafetensorsFile(str(root / "model.safetensors"))
        return {name: f.get(name).dtype for name in f.keys()}

    ours = dtypes(tmp_path / "out")
    assert ours == dtypes(tmp_path / "hf")
    kept = {n for n, d in ours.items() if d == torch.float32}
    assert any("input_layernorm" in n for n in kept)
    assert family == "qwen3_moe" or any("patch_embed" in n for n in kept)


def test_export_writes_its_dtype_and_shards_as_save_pretrained(tmp_path, monkeypatch, caplog):
    """A bf16 source (as published models are) trained in fp32: the default export is the fp32
    master, and its config says so, so that from_pretrained (dtype "auto") loads it unrounded;
    --save-dtype auto writes the source's bf16. Past --save-max-shard-size the weights are
    split as save_pretrained splits them (its index's totals, the library loading every tensor),
    and a later export removes the files it does not overwrite; a failed write leaves the
    earlier export as it was, and an export killed mid-write leaves nothing the next keeps."""
    import json
    import os
    import subprocess

    from protocol.tensors import plan_layout
    from worker.models.hf import shards

    fp32 = fx.model_dir(tmp_path / "fp32", "llama")
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(fp32), dtype=torch.bfloat16)
    reference.save_pretrained(str(tmp_path / "bf16"))
    reference.save_pretrained(str(tmp_path / "hf-shards"), max_shard_size="20KB")

    def export(out, **options):
        model = build_model(ModelConfig(model=f"hf:{tmp_path / 'bf16'}", seq_len=SEQ, **options))
        gen = torch.Generator().manual_seed(0)
        trained = {(p.name, n): t.float() + 1e-3 * torch.randn(t.shape, generator=gen)
                   for p in plan_layout(model.manifest()).layers
                   for n, t in model.loader().load(p).items()}
        model.export(str(out), trained, {})
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype="auto")
        state = loaded.state_dict()
        assert set(state) == {model.family.hf_name(*k) for k in trained}
        return {model.family.hf_name(*k): t for k, t in trained.items()}, state, out

    want, got, out = export(tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert any(not torch.equal(v.bfloat16().float(), v) for v in want.values())

    want, got, _ = export(out, save_dtype="auto")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.bfloat16())
               for k, v in want.items())
    assert (out / "model.safetensors").stat().st_size < sum(v.numel() for v in want.values()) * 3

    want, got, _ = export(out, save_dtype="bf16", save_max_shard_size="20KB")
    assert all(torch.equal(got[k], v.bfloat16()) for k, v in want.items())
    ours = json.loads((out / shards.INDEX).read_text())
    theirs = json.loads((tmp_path / "hf-shards" / shards.INDEX).read_text())
    assert ours["metadata"] == theirs["metadata"] and set(ours["weight_map"]) == \
        set(theirs["weight_map"])
    files = sorted(f.name for f in out.glob("model*.safetensors"))
    assert files == sorted(set(ours["weight_map"].values())) and len(files) > 1
    assert len(files) == len(set(theirs["weight_map"].values()))
    big = max(v.numel() for v in want.values()) * 2
    assert all((out / f).stat().st_size <= max(20_000, big) + 2_000 for f in files)
    assert not (out / "model.safetensors").exists()

    before = {f.name: f.read_bytes() for f in out.iterdir()}
    writes = []
    real = shards.write_safetensors

    def fails_second(path, *a, **k):
        writes.append(path)
        if len(writes) == 2:
            raise OSError(28, "No space left on device")
        return real(path, *a, **k)

    monkeypatch.setattr(shards, "write_safetensors", fails_second)
    with pytest.raises(OSError):
        export(out, save_max_shard_size="30KB")
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    monkeypatch.undo()

    dead = subprocess.Popen(["true"])
    dead.wait()  # an export killed mid-write left its temporary files (a live one's stay,
    host = shards._host()  # and so do another host's: its pids are not ours)
    left = [f".model-00001-of-00002.safetensors.partial-{dead.pid}-{host}.tmp-{dead.pid}",
            f"model.safetensors.index.json.partial-{dead.pid}.tmp-{dead.pid}"]
    stay = [f".model.safetensors.partial-{os.getppid()}-{host}",
            f".model.safetensors.partial-{dead.pid}-other.host"]
    for name in [*left, *stay]:
        (out / name).write_bytes(b"x")
    with caplog.at_level(logging.WARNING):
        want, got, _ = export(out)  # one file again: the shards and their index go
    assert sorted(f.name for f in out.glob("model*")) == ["model.safetensors"]
    assert not any((out / name).exists() for name in left)
    assert all((out / name).exists() for name in stay)
    assert "1 temporary export files of another host" in caplog.text
    assert all(torch.equal(got[k], v) for k, v in want.items())
    with pytest.raises(ValueError, match="save-max-shard-size"):
        ModelConfig(model=f"hf:{fp32}", save_max_shard_size="lots")


@pytest.mark.parametrize("family, kinds", [
    ("mixtral", ["sliding", "sliding"]), ("qwen2_moe", ["block", "block-dense"]),
    ("qwen3_moe", ["block-dense", "block"]), ("olmoe", ["block", "block"]),
    ("deepseek_v3", ["block-dense", "block"]), ("glm4_moe", ["block-dense", "block"]),
    ("gpt_oss", ["sliding", "block"]), ("minimax_m2", ["block", "block"]),
    ("deepseek_v2", ["block-dense", "block"]), ("dots1", ["block-dense", "block"]),
    ("qwen3_next", ["linear", "block"]), ("qwen3_5_moe_text", ["linear", "block"]),
    ("mistral4", ["block-dense", "block"]), ("ernie4_5_moe", ["block-dense", "block"]),
    ("granitemoe", ["block", "block"]), ("llama4_text", ["chunked", "block-nope-dense"]),
    ("gemma4_text", ["sliding", "block"]), ("hunyuan_v1_moe", ["block", "block"]),
    ("solar_open", ["block", "block"]), ("exaone_moe", ["sliding-dense", "block"]),
    ("hy_v3", ["block-dense", "block"]), ("afmoe", ["sliding-dense", "block"]),
    ("deepseek_v32", ["block-dense", "block"]), ("glm4_moe_lite", ["block-dense", "block"]),
    ("cohere2_moe", ["sliding", "block"]), ("minimax", ["linear", "sliding"]),
    ("flex_olmo", ["block", "block"]), ("mimo_v2_flash", ["block-dense", "sliding"]),
    ("phimoe", ["sliding", "sliding"]), ("granitemoehybrid", ["linear", "block"]),
    ("kimi_linear", ["linear-dense", "block"])])
def test_a_mixture_of_experts_reads_and_writes_its_experts_as_the_library(tmp_path, family,
                                                                           kinds):
    """The library stacks a MoE layer's experts (each expert's gate rows, then its up rows;
    the down projections) where a checkpoint keeps one Linear per expert (Mixtral's under
    other names): every loaded tensor equals from_pretrained's, and export writes the
    checkpoint's own names and bytes, as save_pretrained does. Qwen-MoE's, DeepSeek's,
    GLM-4.5's and dots.llm1's dense layers are a block kind of their own, as are Qwen3-Next's
    linear-attention layers; a routing bias
    (DeepSeek-V3, GLM-4.5, MiniMax-M2, dots.llm1, K-EXAONE, Hunyuan 3, AFMoE: a buffer in the
    library, a tensor in the checkpoint, K-EXAONE's and Hunyuan 3's under other names), and
    Gemma 4's layer scalar, are read and written, and frozen (--freeze may name them).
    gpt-oss's checkpoints keep the stacks (with biases) as the library does."""
    from protocol.safetensors_io import SafetensorsFile
    from protocol.tensors import plan_layout

    path = fx.model_dir(tmp_path / "model", family, biases=True)
    model = build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ))
    assert [k for _, k in model.layer_kinds()[1:-1]] == kinds
    loaded = {(p.name, n): t for p in plan_layout(model.manifest()).layers
              for n, t in model.loader().load(p).items()}
    state = getattr(transformers, fx.DECODERS[family][1]).from_pretrained(str(path)).state_dict()
    named = {model.family.hf_name(*k): t for k, t in loaded.items()}
    tied = {"lm_head.weight"} if model.ties() else set()  # (ERNIE 4.5: one stored tensor)
    assert set(state) - tied == set(named)
    assert sum(k.endswith("experts.gate_up_proj") for k in named) == sum(
        k in ("block", "sliding", "linear", "chunked") for k in kinds)
    for name, t in named.items():
        assert torch.equal(state[name], t), name
    frozen = {f"{la.name}.{t.name}" for la in model.manifest().layers for t in la.tensors
              if t.group == "frozen"}
    assert frozen == {f"{la}.{t}" for la, t in loaded if t.endswith(
        ("e_score_correction_bias", "expert_bias", "layer_scalar", "slope_rate", "_decay"))
        or ".indexer." in t}  # (MiniMax's lightning attention: its decays, buffers too)
    assert (".indexer." in str(frozen)) is (family == "deepseek_v32")  # (never has gradients)
    assert bool(frozen) is (family in ("deepseek_v3", "glm4_moe", "minimax_m2", "dots1",
                                       "ernie4_5_moe", "gemma4_text", "solar_open",
                                       "exaone_moe", "hy_v3", "afmoe", "deepseek_v32",
                                       "glm4_moe_lite", "minimax", "mimo_v2_flash",
                                       "kimi_linear"))
    if frozen:  # --freeze may name it (a pattern that matches only it is not "unused")
        build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ,
                                freeze="*." + min(frozen).rsplit(".", 1)[1])).manifest()
    model.export(str(tmp_path / "out"), loaded, {})
    source = SafetensorsFile(str(path / "model.safetensors"))
    out = SafetensorsFile(str(tmp_path / "out" / "model.safetensors"))
    assert set(out.keys()) == set(source.keys())
    for name in source.keys():
        assert torch.equal(out.get(name), source.get(name)), name


@pytest.mark.parametrize("family", ["deepseek_v3", "minimax"])
def test_a_checkpoint_without_its_buffers_gets_the_library_values(tmp_path, family, caplog):
    """A checkpoint lacking a block's persistent buffers (a routing bias, MiniMax's decays,
    which depend on the layer) loads as from_pretrained loads it, with the values the
    library's layer makes, and says so; a missing weight is still refused."""
    from safetensors.torch import load_file, save_file

    from protocol.tensors import plan_layout

    over = dict(num_hidden_layers=3, layer_types=["linear_attention"] * 2 + [
        "full_attention"]) if family == "minimax" else {}  # (two lightning layers)
    path = fx.model_dir(tmp_path / "model", family, biases=True, **over)
    state = load_file(str(path / "model.safetensors"))
    buffers = {k for k in state if k.endswith(("e_score_correction_bias", "slope_rate", "_decay"))}
    save_file({k: v for k, v in state.items() if k not in buffers},
              str(path / "model.safetensors"), {"format": "pt"})
    want = transformers.AutoModelForCausalLM.from_pretrained(str(path)).state_dict()
    model = build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ))
    loaded = {model.family.hf_name(p.name, n): t for p in plan_layout(model.manifest()).layers
              for n, t in model.loader().load(p).items()}
    assert buffers and all(torch.equal(loaded[k], want[k]) for k in buffers)
    if family == "deepseek_v3":  # (the fixture's bias is random: not the library's zeros)
        assert all(not torch.equal(loaded[k], state[k]) for k in buffers)
    else:  # each layer's own
        rates = [loaded[k] for k in sorted(buffers) if k.endswith("slope_rate")]
        assert len(rates) == 2 and not torch.equal(*rates)
    assert "the library's values" in caplog.text

    weight = next(k for k in state if k.endswith("q_proj.weight") or k.endswith("q_a_proj.weight"))
    save_file({k: v for k, v in state.items() if k != weight},
              str(path / "model.safetensors"), {"format": "pt"})
    with pytest.raises(ValueError, match="has no tensor"):
        for p in plan_layout(model.manifest()).layers:
            build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ)).loader().load(p)


def _fp8_checkpoint(src, dst, block: tuple[int, int]):
    """``src``'s projections quantized as DeepSeek-V3's published checkpoint is: float8 e4m3
    with one fp32 scale per block (``<name>_scale_inv``), the rest as it was."""
    import json

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    out = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not name.endswith("proj.weight"):
            out[name] = w
            continue
        rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
        padded = torch.zeros(rows * block[0], cols * block[1])
        padded[:w.shape[0], :w.shape[1]] = w
        amax = padded.view(rows, block[0], cols, block[1]).abs().amax((1, 3))
        scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        out[name] = (w / full[:w.shape[0], :w.shape[1]]).to(torch.float8_e4m3fn)
        out[name + "_scale_inv"] = scale
    save_file(out, str(dst / "model.safetensors"), {"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config))
    return out


def test_a_fine_grained_fp8_checkpoint_is_read_dequantized(tmp_path):
    """DeepSeek-V3 as published (FP8 weights, a scale per 128 x 128 block; here 4 x 4): every
    weight reads as the library dequantizes it on the CPU (fp32, float(q) * scale), an edge
    block smaller where the grid rounds up; export writes full precision with no
    quantization_config (from_pretrained loads it as a plain model); another quantization is
    refused at once."""
    import json

    from protocol.tensors import plan_layout
    from worker.models.hf import quantized

    src = fx.model_dir(tmp_path / "model", "deepseek_v3")
    stored = _fp8_checkpoint(src, tmp_path / "fp8", (4, 4))
    model = build_model(ModelConfig(model=f"hf:{tmp_path / 'fp8'}", seq_len=SEQ))
    loaded = {model.family.hf_name(p.name, n): (p.name, n, t)
              for p in plan_layout(model.manifest()).layers
              for n, t in model.loader().load(p).items()}
    state = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "fp8"), dtype=torch.float32).state_dict()
    assert set(state) == set(loaded)
    for name, (_, _, t) in loaded.items():
        assert t.dtype == torch.float32 and torch.equal(state[name], t), name
    assert sum(k.endswith("_scale_inv") for k in stored) > 10

    ragged = torch.randn(6, 10).to(torch.float8_e4m3fn)  # blocks of 4 x 4: 2 x 3, edges cut
    scale = torch.rand(2, 3) + 0.5
    want = torch.tensor([[float(ragged[i, j]) * float(scale[i // 4, j // 4])
                          for j in range(10)] for i in range(6)])
    assert torch.equal(quantized.dequantize(ragged, scale, (4, 4)), want)
    with pytest.raises(ValueError, match="one per 4 x 4 block"):
        quantized.dequantize(ragged, scale[:1], (4, 4))

    model.export(str(tmp_path / "out"), {(la, n): t for la, n, t in loaded.values()}, {})
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert all(torch.equal(again.state_dict()[k], v) for k, v in state.items())

    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "out" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="only fine-grained FP8 and MXFP4"):
        build_model(ModelConfig(model=f"hf:{tmp_path / 'out'}"))


def test_an_mxfp4_checkpoint_is_read_dequantized(tmp_path):
    """gpt-oss as published: each expert stack as MXFP4 (``_blocks``: two e2m1 values a byte,
    ``_scales``: a power of two per 32 values, out x in): every tensor reads as the library
    dequantizes it on the CPU; export writes the stacks in full precision."""
    import json

    from safetensors.torch import load_file, save_file

    from protocol.tensors import plan_layout
    from worker.models.hf import quantized

    src = fx.model_dir(tmp_path / "model", "gpt_oss", intermediate_size=32)
    lut = torch.tensor(quantized.E2M1[:8])
    out = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name] = w
            continue
        groups = w.transpose(1, 2).unflatten(-1, (-1, 32))  # experts x out x in/32 x 32
        exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0))
        scaled = groups / torch.exp2(exp).unsqueeze(-1)
        code = (scaled.abs().unsqueeze(-1) - lut).abs().argmin(-1) + 8 * (scaled < 0)
        out[name + "_blocks"] = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
        out[name + "_scales"] = (exp + 127).to(torch.uint8)
    (tmp_path / "mxfp4").mkdir()
    save_file(out, str(tmp_path / "mxfp4" / "model.safetensors"), {"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))

    model = build_model(ModelConfig(model=f"hf:{tmp_path / 'mxfp4'}", seq_len=SEQ))
    loaded = {model.family.hf_name(p.name, n): (p.name, n, t)
              for p in plan_layout(model.manifest()).layers
              for n, t in model.loader().load(p).items()}
    state = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "mxfp4"), dtype=torch.float32,
        quantization_config=transformers.Mxfp4Config(dequantize=True)).state_dict()
    assert set(state) == set(loaded)
    stacks = [k for k in loaded if k.endswith("_proj")]
    assert len(stacks) == 4
    for name, (_, _, t) in loaded.items():
        assert t.dtype == torch.float32 and torch.equal(state[name], t), name
    original = load_file(str(src / "model.safetensors"))
    for name in stacks:  # (4-bit: near the original, not equal)
        assert (loaded[name][2] - original[name]).abs().max() < 0.3 * original[name].abs().max()
    model.export(str(tmp_path / "out"), {(la, n): t for la, n, t in loaded.values()}, {})
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert all(torch.equal(again.state_dict()[k], v) for k, v in state.items())


@pytest.mark.parametrize("family", ["gemma3-vlm", "mistral3-vlm", "mistral4-vlm", "qwen3_5-vlm",
                                    "llama4-vlm", "gemma4-vlm"])
def test_a_multimodal_checkpoint_trains_its_language_model(tmp_path, family):
    """Gemma 3, Mistral 3 (and Mistral 4 inside it), Qwen3.5 (...ForConditionalGeneration):
    the language model trains on text as the library's text-only causal LM with the same
    weights trains (dropout 0.1, padding), and export writes the whole multimodal model again
    (save_pretrained's names, nothing missing or left over): the trained language model, the
    vision tower and projector as they were; a LoRA adapter of it loads with PEFT, which then
    adapts no part of the vision tower."""
    import shutil

    from peft import PeftModel

    from protocol.tensors import plan_layout

    path = fx.model_dir(tmp_path / "model", family)
    arch = fx.MULTIMODAL[family][1]
    full = getattr(transformers, arch).from_pretrained(str(path))
    text_config = full.config.text_config  # tied as the whole model says (the library's rule)
    text_config.tie_word_embeddings = full.config.tie_word_embeddings
    text = getattr(transformers, families.hf_class(text_config, families.DECODER))(text_config)
    cfg = ModelConfig(model=f"hf:{path}", seq_len=SEQ)
    held = build_model(cfg).wrapper.in_memory  # (the library's name for a text model's)
    source = full.state_dict()
    text.load_state_dict({k: source[held(k)] for k in text.state_dict()})
    text.save_pretrained(str(tmp_path / "text"))
    shutil.copy(path / "tokenizer.json", tmp_path / "text")
    shutil.copy(path / "tokenizer_config.json", tmp_path / "text")
    data = data_for(family, tmp_path)
    got = train_local_l2l(cfg, steps=3, micro_batches=2, batch_size=4, data=data)
    want = train_hf(str(tmp_path / "text"), data, steps=3, micro_batches=2, batch_size=4,
                    seq_len=SEQ)
    assert set(got) == {k for k in want if k in text.state_dict() and k != "lm_head.weight"} \
        | ({"lm_head.weight"} if "lm_head.weight" in got else set())
    assert_close(got, {k: want[k] for k in got})

    model = build_model(cfg)
    names = {model.family.hf_name(p.name, t.name): (p.name, t.name)
             for p in plan_layout(model.manifest()).layers for t in p.tensors}
    model.export(str(tmp_path / "out"), {names[k]: v for k, v in got.items()}, {})
    again, info = getattr(transformers, arch).from_pretrained(str(tmp_path / "out"),
                                                              output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    state = again.state_dict()
    for k, v in got.items():
        assert torch.equal(state[held(k)], v), k
    others = [k for k in source if not model.wrapper.is_language(k)]
    assert others and all(torch.equal(state[k], source[k]) for k in others)

    # a checkpoint under the library's own names (model.language_model.*) reads alike
    from safetensors.torch import save_file

    shutil.copytree(path, tmp_path / "own")
    save_file({k: v.contiguous() for k, v in source.items()
               if not (k == "lm_head.weight" and full.config.tie_word_embeddings)},
              str(tmp_path / "own" / "model.safetensors"))
    own = build_model(ModelConfig(model=f"hf:{tmp_path / 'own'}", seq_len=SEQ))
    for p in plan_layout(model.manifest()).layers:
        a, b = model.loader().load(p), own.loader().load(p)
        assert all(torch.equal(a[n], b[n]) for n in a)
    own.export(str(tmp_path / "own-out"), {names[k]: v for k, v in got.items()}, {})
    mixed = getattr(transformers, arch).from_pretrained(str(tmp_path / "own-out")).state_dict()
    assert all(torch.equal(mixed[k], state[k]) for k in state)

    targets = "q_b_proj,kv_b_proj" if family == "mistral4-vlm" else "auto"  # (latent attention)
    lora = build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ, lora_rank=4,
                                   lora_targets=targets))
    tensors = {(p.name, n): torch.randn_like(v) / 8 if "lora_B" in n else v
               for p in plan_layout(lora.manifest()).layers
               for n, v in lora.loader().load(p).items()}
    lora.export(str(tmp_path / "adapter"), tensors, {})
    adapted = PeftModel.from_pretrained(getattr(transformers, arch).from_pretrained(str(path)),
                                        str(tmp_path / "adapter"))
    adapters = {k for k in adapted.state_dict() if ".lora_" in k}
    assert adapters and all(".language_model." in k for k in adapters)
    loaded = adapted.state_dict()
    for (layer, n), v in tensors.items():
        if ".lora_" in n:
            name = lora.wrapper.in_memory(lora.family.hf_name(layer, n))
            assert torch.equal(loaded[f"base_model.model.{name}".replace(
                ".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")], v)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "gpt_oss", "qwen3_next", "granitemoe",
                                    "ernie4_5_moe", "minimax", "phimoe", "flex_olmo",
                                    "granitemoehybrid"])
def test_a_mixture_of_experts_trains_with_its_load_balancing_loss(tmp_path, family):
    """output_router_logits: the routers' load-balancing loss (every MoE layer's routing of a
    micro-batch together, padding left out), carried from layer to layer, trains as the
    library's: L2L equals the library's model trained on its cross-entropy plus
    router_aux_loss_coef times the aux_loss it returns (each micro-batch's weighted by its
    share of the batch's loss terms); the loss matters (the routers end elsewhere without it)
    and is left out of an evaluation's loss. Qwen2-MoE: a dense layer passes the totals on;
    gpt-oss: its router has a bias; Qwen3-Next: a linear-attention layer among them;
    GraniteMoE's, ERNIE 4.5's and PhiMoE's routers; MiniMax's among lightning attention."""
    over = dict(output_router_logits=True, router_aux_loss_coef=0.5)
    path = fx.model_dir(tmp_path / "model", family, **over)
    data = data_for(family, tmp_path)
    cfg = ModelConfig(model=f"hf:{path}", seq_len=SEQ)
    got = train_local_l2l(cfg, steps=3, micro_batches=2, batch_size=4, data=data)
    want = train_hf(str(path), data, steps=3, micro_batches=2, batch_size=4, seq_len=SEQ)
    assert_close(got, {k: v for k, v in want.items() if k in got})
    plain = fx.model_dir(tmp_path / "plain", family)  # the same weights, no balancing loss
    without = train_hf(str(plain), data, steps=3, micro_batches=2, batch_size=4, seq_len=SEQ)
    router = {"gpt_oss": "model.layers.0.mlp.router.weight",
              "granitemoe": "model.layers.0.block_sparse_moe.router.weight",
              "granitemoehybrid": "model.layers.0.block_sparse_moe.router.weight",
              "ernie4_5_moe": "model.layers.1.mlp.gate.weight",  # (its layer 0: dense)
              "phimoe": "model.layers.0.mlp.router.weight"}.get(
                  family, "model.layers.0.mlp.gate.weight")
    assert not torch.allclose(without[router], want[router], atol=1e-4)

    model = build_model(cfg)
    batch = build_task(model, data, micro_batch_size=4, global_micro_batches=2).micro_batch(
        0, 0, 4, 1.0)
    assert batch.mask is not None and (batch.mask == 0).any()  # padding left out
    with torch.no_grad():
        evaluated = [build_model(ModelConfig(model=f"hf:{p}", seq_len=SEQ)).assemble().eval()(
            batch, rng=(0, 0, 0))[0] for p in (path, plain)]
    assert torch.equal(*evaluated)

def test_a_decoder_classifier_pads_with_what_it_pools_by(tmp_path):
    """A causal LM's tokenizer without a padding token (as Llama 3's): the classifier takes its
    end-of-text as padding, the data pads with it, export writes it, and training equals the
    library's classifier with that config; a type transformers has no classifier for is
    refused before training."""
    path = fx.model_dir(tmp_path / "model", "llama")
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    tok.pad_token = None
    tok.save_pretrained(str(path))
    mcfg = ModelConfig(model=f"hf:{path}", seq_len=SEQ, classes=3)
    model = build_model(mcfg)
    eos = tok.eos_token_id
    assert model.config.pad_token_id == eos != 0 and model.export_config().pad_token_id == eos
    data = data_for("llama", tmp_path, classes=3)
    b = build_task(model, data, micro_batch_size=4, global_micro_batches=2).micro_batch(
        0, 0, 4, 1.0)
    assert (b.inputs[b.mask == 0] == eos).all() and (b.mask == 0).any()
    got = train_local_l2l(mcfg, steps=2, micro_batches=2, batch_size=4, data=data)
    want = train_hf(str(path), data, steps=2, micro_batches=2, batch_size=4, seq_len=SEQ,
                    classes=3)
    assert_close(got, {k: v for k, v in want.items() if k in got})
    granite = fx.model_dir(tmp_path / "granite", "granite")
    with pytest.raises(ValueError, match="no sequence classifier for granite"):
        build_model(ModelConfig(model=f"hf:{granite}", classes=3))


def test_unsupported_configs_are_refused(tmp_path):
    path = fx.model_dir(tmp_path / "model", "gpt2", scale_attn_by_inverse_layer_idx=True)
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        build_model(ModelConfig(model=f"hf:{path}"))
    for why, over in (("hidden_size_per_layer_input", dict(hidden_size_per_layer_input=8)),
                      ("num_kv_shared_layers", dict(num_kv_shared_layers=1, num_hidden_layers=3,
                                                    layer_types=["sliding_attention",
                                                                 "full_attention"] + [
                                                        "full_attention"])),
                      ("bidirectional", dict(use_bidirectional_attention="all"))):
        gemma4 = fx.model_dir(tmp_path / why, "gemma4_text",
                              **over)  # (the layers are not apart: per-layer inputs, shared KV)
        with pytest.raises(ValueError, match=why):
            build_model(ModelConfig(model=f"hf:{gemma4}"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read a Hugging Face config"):
        build_model(ModelConfig(model=f"hf:{tmp_path / 'bad'}"))
    # RoBERTa's positions start after its padding index (0 here): 63 of its 64 are usable
    roberta = fx.model_dir(tmp_path / "roberta", "roberta")
    assert build_model(ModelConfig(model=f"hf:{roberta}", seq_len=63))
    with pytest.raises(ValueError, match="exceeds the 63 positions"):
        build_model(ModelConfig(model=f"hf:{roberta}", seq_len=64))
    # rotary positions have no table: they go on past max_position_embeddings, as the
    # library's do (it was refused as if they had one)
    llama = fx.model_dir(tmp_path / "llama", "llama", max_position_embeddings=8)
    assert build_model(ModelConfig(model=f"hf:{llama}", seq_len=16))
    gpt2 = fx.model_dir(tmp_path / "gpt2", "gpt2", n_positions=8)
    with pytest.raises(ValueError, match="exceeds the 8 positions"):
        build_model(ModelConfig(model=f"hf:{gpt2}", seq_len=16))


def test_evaluation_equals_the_library_model(tmp_path):
    """The forward-only L2L pass, split over 2 ranks, sums to the library model's loss and
    correct predictions on the same padded eval data."""
    import torch.nn.functional as F

    from bench.local import LocalSource
    from eps_server.config import OptimizerConfig
    from protocol.tensors import plan_layout
    from worker.data import Sharder, build_eval
    from worker.executor import Executor

    for family in ("bert", "llama"):
        path = fx.model_dir(tmp_path / family, family)
        train = data_for(family, tmp_path)
        dev = fx.classification_tsv(tmp_path / "dev.tsv", n=22, seed=9) if family == "bert" \
            else fx.lm_jsonl(tmp_path / "dev.jsonl", n=22, seed=9)
        data = DataConfig(data=train.data, eval_data=str(dev))
        model = build_model(ModelConfig(model=f"hf:{path}", seq_len=SEQ))
        layout = plan_layout(model.manifest())
        source = LocalSource(model, layout, OptimizerConfig())
        task = build_task(model, data, micro_batch_size=4, global_micro_batches=2)
        ex = Executor(model, layout, source, Sharder(task, 4, 2), device=torch.device("cpu"),
                      micro_batches=range(2), steps=1, dropout=model.dropout, seed=0)
        totals = [ex.evaluate(0, build_eval(model, data, 4, r, 2).batches(), False)
                  for r in range(2)]
        hf = getattr(transformers, model.export_config().architectures[0]).from_pretrained(
            str(path), attn_implementation="sdpa").eval()
        loss = correct = 0.0
        for b in build_eval(model, data, 4, 0, 1).batches():
            kw = {"token_type_ids": b.token_types} if b.token_types is not None else {}
            with torch.no_grad():
                logits = hf(input_ids=b.inputs, attention_mask=b.mask, **kw).logits
            flat, targets = logits.reshape(-1, logits.shape[-1]).float(), b.targets.reshape(-1)
            loss += float(F.cross_entropy(flat, targets, reduction="sum"))
            correct += int((flat.argmax(-1) == targets).sum())
        assert abs(sum(t[0] for t in totals) - loss) < 1e-4 * loss
        assert sum(t[1] for t in totals) == correct


def test_checkpoint_names_labels_and_windows(tmp_path):
    """A missing tensor (other than a new head) is refused, old gamma/beta LayerNorm names are
    read, --classes must agree with a classifier checkpoint and is needed for a base one, and
    a Llama config's sliding_window is ignored as LlamaModel ignores it."""
    from safetensors.torch import load_file, save_file

    from protocol.tensors import plan_layout

    path = fx.model_dir(tmp_path / "bert", "bert")
    with pytest.raises(ValueError, match="classifier has 3 labels, --classes says 5"):
        build_model(ModelConfig(model=f"hf:{path}", classes=5))
    base = fx.model_dir(tmp_path / "base", "bert-base")
    with pytest.raises(ValueError, match="give --classes"):
        build_model(ModelConfig(model=f"hf:{base}"))
    gpt2 = fx.model_dir(tmp_path / "gpt2", "gpt2")  # no classifier here: not ignored
    with pytest.raises(ValueError, match="--classes 2: a gpt2 model trains here as a language"):
        build_model(ModelConfig(model=f"hf:{gpt2}", classes=2))
    weights = load_file(str(path / "model.safetensors"))
    old = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias",
                                                                     "LayerNorm.beta"): v
           for k, v in weights.items()}
    save_file(old, str(path / "model.safetensors"))
    model = build_model(ModelConfig(model=f"hf:{path}"))
    pre = plan_layout(model.manifest()).layers[0]
    assert torch.equal(model.loader().load(pre)["embeddings.LayerNorm.weight"],
                       weights["bert.embeddings.LayerNorm.weight"])
    del old["bert.embeddings.LayerNorm.gamma"]
    save_file(old, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="no tensor 'bert.embeddings.LayerNorm.weight'"):
        build_model(ModelConfig(model=f"hf:{path}")).loader().load(pre)
    llama = fx.model_dir(tmp_path / "llama", "llama", sliding_window=4)
    assert {k for _, k in build_model(ModelConfig(model=f"hf:{llama}")).layer_kinds()} == \
        {"embed", "block", "head"}
    mistral = fx.model_dir(tmp_path / "mistral", "mistral")
    assert "sliding" in {k for _, k in build_model(ModelConfig(model=f"hf:{mistral}"))
                         .layer_kinds()}
    with pytest.raises(ValueError, match="is the source directory"):
        model.export(str(path), {}, {})
