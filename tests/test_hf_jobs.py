"""Hugging Face models and text data through real eps-server and l2l-worker processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from .baseline import assert_close
from .helpers import ENV, SMALL
from .hf_baseline import train_hf
from .test_hf import SEQ, data_for

transformers = pytest.importorskip("transformers")
from . import hf_fixtures as fx  # noqa: E402  (needs transformers)


def job(cluster, workers, path, data, *extra, steps=5, micro_batches=2, server=()):
    out = cluster.tmp / f"out-{len(cluster.procs)}"
    cluster.run_job(workers, *SMALL, "--model", f"hf:{path}", "--data", data.data,
                    *(("--text-column", data.text_column) if data.text_column != "sentence"
                      else ()),
                    "--steps", str(steps), "--micro-batches", str(micro_batches),
                    "--save", str(out), *extra, server_args=("--lr", "1e-3", *server))
    return load_file(str(out / "model.safetensors")), out


# BERT slow: an encoder classifier runs through the processes as RoBERTa's (which also takes its
# new head from the bootstrapping worker); every family trains exactly in-process (test_hf.py).
@pytest.mark.parametrize("family, architecture, over, extra", [
    pytest.param("bert", "BertForSequenceClassification", {}, (), marks=pytest.mark.slow),
    ("roberta-mlm", "RobertaForSequenceClassification", {}, ("--classes", "3")),
    ("gpt2", "GPT2LMHeadModel", {}, ()), ("qwen3", "Qwen3ForCausalLM", {}, ()),
    ("qwen3_moe", "Qwen3MoeForCausalLM", {"output_router_logits": True}, ("--stash", "eps")),
    ("deepseek_v3", "DeepseekV3ForCausalLM", {}, ())])
def test_two_workers_train_the_library_model_exactly(cluster, tmp_path, family, architecture,
                                                     over, extra):
    """2 workers x 2 micro-batches, 5 steps, dropout 0.1, padded batches: the exported model,
    read back by from_pretrained, equals the library's model trained on all 4 micro-batches
    (1e-5 abs + 1e-4 rel); a masked LM's new classifier comes from the bootstrapping worker, as
    the baseline's does; a mixture of experts (a dense layer and a MoE one) with its
    load-balancing loss, whose routing totals cross the EPS's stash beside the hidden states,
    is written with one tensor per expert and stacked again by the library; DeepSeek-V3's
    routing bias is served as a frozen tensor and written back (fp32 here)."""
    path = fx.model_dir(tmp_path / "model", family, **over)
    data = data_for(family, tmp_path)
    classes = 3 if family == "roberta-mlm" else 0
    _, out = job(cluster, 2, path, data, *extra)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [architecture]
    got = getattr(transformers, architecture).from_pretrained(str(out)).state_dict()
    want = train_hf(str(path), data, steps=5, micro_batches=4, batch_size=4, seq_len=SEQ,
                    classes=classes)
    assert set(got) == set(want)
    assert_close(got, want)


@pytest.mark.slow  # the default set has test_two_workers_train_the_library_model_exactly[gpt2]
def test_the_split_does_not_matter_on_text(cluster, tmp_path):
    """2 workers x 2 micro-batches of text end where 1 worker x 4 does. (In the default set:
    2 x 2 against the library's model trained on all 4 micro-batches in one process, above,
    and 1 x 4 against 2 x 2 through the EPS, test_training.py's test_split_does_not_matter.)"""
    path = fx.model_dir(tmp_path / "model", "gpt2")
    data = data_for("gpt2", tmp_path)
    a, _ = job(cluster, 2, path, data, steps=4)
    cluster.close()
    b, _ = job(cluster, 1, path, data, steps=4, micro_batches=4)
    assert_close(a, b)


def test_a_resumed_run_continues_at_the_same_data_position(cluster, tmp_path):
    """48 documents, 16 per step: 9 steps cross epochs (reshuffled by (seed, epoch)). A run
    resumed from step 3's checkpoint to 9 ends bitwise equal to the run that wrote it; one
    resumed with half the batch goes on from sample 48, not from 3 x its 8."""
    path = fx.model_dir(tmp_path / "model", "gpt2")
    data = data_for("gpt2", tmp_path)
    ckpt = tmp_path / "ckpt"
    straight, _ = job(cluster, 2, path, data, steps=9, server=(
        "--server-save", str(ckpt), "--checkpoint-every", "3", "--keep-checkpoints", "3"))
    cluster.close()
    resumed, _ = job(cluster, 2, path, data, steps=9,
                     server=("--load", str(ckpt / "step-00000003")))
    assert "at step 3" in cluster.log(cluster.procs[-1])
    assert "step 3 starts at sample 48 of the data" in cluster.log(cluster.procs[-1])
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
    cluster.close()
    job(cluster, 1, path, data, steps=4, server=("--load", str(ckpt / "step-00000003")))
    assert "step 3 starts at sample 48 of the data" in cluster.log(cluster.procs[-1])


def test_an_exported_checkpoint_loads_with_from_pretrained(cluster, tmp_path, capsys):
    """l2l-export turns an EPS checkpoint into the directory --save writes (one trained with
    bf16 optimizer moments: export reads the fp32 master only), also rounded to bf16 and split
    into shards."""
    path = fx.model_dir(tmp_path / "model", "gpt2")
    data = data_for("gpt2", tmp_path)
    saved, _ = job(cluster, 1, path, data, steps=2, server=(
        "--server-save", str(tmp_path / "ckpt"), "--optimizer-states", "bf16"))
    from worker.export import main as export  # l2l-export's own main, in this process

    assert export(["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "exported"),
                   "--model", f"hf:{path}", "--seq-len", str(SEQ)]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"))
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.items())
    assert export([str(tmp_path / "ckpt"), str(tmp_path / "bf16"), "--model", f"hf:{path}",
                   "--seq-len", str(SEQ), "--save-dtype", "bf16",
                   "--save-max-shard-size", "20KB"]) == 0
    assert len(list((tmp_path / "bf16").glob("model-*-of-*.safetensors"))) > 1
    state = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16")).state_dict()
    assert all(torch.equal(state[k], v.bfloat16()) for k, v in saved.items())
    capsys.readouterr()
    assert export(["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "x"),
                   "--model", "gpt"]) == 1
    assert "do not describe the checkpoint's model" in capsys.readouterr().err


def test_eval_perplexity_falls_on_a_text_file(tmp_path):
    """GPT-2 on a plain text file (tokenised by its tokenizer, cut into windows) through
    l2l-launch: held-out perplexity after 30 steps is well below the untrained model's
    (evaluated before the first step)."""
    path = fx.model_dir(tmp_path / "model", "gpt2")
    train = fx.phrase_text(tmp_path / "train.txt", lines=400)
    dev = fx.phrase_text(tmp_path / "dev.txt", lines=60, sample_seed=1)  # held out
    summary = tmp_path / "s.json"
    p = subprocess.run([sys.executable, "-m", "launch", "--quiet",
                        "--runs-dir", str(tmp_path / "runs"),
                        "--workers", "2",
                        "--model", f"hf:{path}", "--data", str(train), "--eval-data", str(dev),
                        "--eval-every", "15", "--steps", "30", "--seq-len", "32",
                        "--micro-batch-size", "8", "--lr", "3e-3", "--threads", "1",
                        "--summary-json", str(summary),
                        "--endpoint", f"ipc://{tmp_path}/eps.sock"],
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    s = json.loads(summary.read_text())
    evals = s["eval"]
    assert [e["step"] for e in evals] == [0, 15, 30]
    import transformers  # the summary reports the model's own size, not built-in defaults

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    assert s["model"]["params"] == sum(p.numel() for p in hf.parameters())
    assert "hidden" not in s["model"] and s["model"]["seq_len"] == 32
    assert evals[-1]["perplexity"] < 0.5 * evals[0]["perplexity"], evals
    assert "perplexity" in p.stdout


def test_hf_to_l2l_to_hf_with_zero_steps_is_bitwise_identical(cluster, tmp_path):
    """Bootstrapped through the EPS from a sharded checkpoint and saved back untouched."""
    src = fx.model_dir(tmp_path / "model", "llama")
    sharded = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(str(src)).save_pretrained(
        str(sharded), max_shard_size="40KB")
    for name in fx.TOKENIZER_FILES:
        if (src / name).exists():
            (sharded / name).write_bytes((src / name).read_bytes())
    assert (sharded / "model.safetensors.index.json").exists()
    got, _ = job(cluster, 1, sharded, data_for("llama", tmp_path), steps=0)
    want = transformers.AutoModelForCausalLM.from_pretrained(str(src)).state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_a_bad_data_file_is_refused_before_training(cluster, tmp_path):
    path = fx.model_dir(tmp_path / "model", "bert")
    bad = tmp_path / "bad.tsv"
    bad.write_text("sentence\tlabel\nthe movie was good\t1\nit was bad\tnegative\n")
    started = []  # the worker starts beside the EPS (it would wait for it, then say Hello)
    cluster.start_server(1, workers=lambda: started.append(cluster.worker(
        0, 1, *SMALL, "--model", f"hf:{path}", "--data", str(bad))))
    [w] = started
    assert cluster.wait(w) == 1
    log = cluster.log(w)
    assert "bad.tsv:3: label 'negative' is not an integer" in log
    assert "joined run" not in log  # refused before saying Hello
