"""Data files: every format, every refusal with its line, the token cache, the order of samples
and the loss normaliser (real targets only)."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch

from worker.config import DataConfig, ModelConfig
from worker.data import DataError, Sharder, build_eval, build_task
from worker.data.textsets import Order
from worker.models import build_model

transformers = pytest.importorskip("transformers")
from . import hf_fixtures as fx  # noqa: E402  (needs transformers)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("models")
    return {f: build_model(ModelConfig(model=f"hf:{fx.model_dir(base / f, f)}", seq_len=16))
            for f in ("bert", "gpt2")}


def task(model, path, **kw):
    return build_task(model, DataConfig(data=str(path), **kw), micro_batch_size=4,
                      global_micro_batches=2)


def test_every_format(models, tmp_path):
    bert, gpt2 = models["bert"], models["gpt2"]
    tsv = fx.classification_tsv(tmp_path / "a.tsv")
    b = task(bert, tsv).micro_batch(0, 0, 4, 8.0)
    assert b.inputs.shape[0] == 4 and b.targets.shape == (4,) and b.mask is not None
    pairs = fx.classification_tsv(tmp_path / "p.tsv", pairs=True)
    b = task(bert, pairs, text_column="sentence1", text_pair_column="sentence2") \
        .micro_batch(0, 0, 4, 8.0)
    assert b.token_types is not None and (b.token_types == 1).any()
    (tmp_path / "a.csv").write_text('sentence,label\n"good, very good",1\nbad,0\nfine,2\n')
    assert task(bert, tmp_path / "a.csv").n == 3
    (tmp_path / "long.tsv").write_text("sentence\tlabel\n" + "good " * 60_000 + "\t1\nbad\t0\n")
    assert task(bert, tmp_path / "long.tsv").n == 2  # a field past csv's 128 KiB default
    (tmp_path / "c.jsonl").write_text('{"text": "good movie", "label": 1}\n\n'
                                      '{"text": "bad", "label": 0}\n')
    assert task(bert, tmp_path / "c.jsonl").enc.labels.tolist() == [1, 0]
    lm = task(gpt2, fx.lm_jsonl(tmp_path / "lm.jsonl")).micro_batch(0, 0, 4, 1.0)
    assert lm.targets.shape == lm.inputs.shape and (lm.targets == -100).any()
    (tmp_path / "t.txt").write_text("the movie was good and the story was fine\n" * 20)
    stream = task(gpt2, tmp_path / "t.txt").micro_batch(0, 0, 4, 1.0)
    assert stream.inputs.shape == (4, 16) and stream.mask is None
    assert torch.equal(stream.inputs[:, 1:], stream.targets[:, :-1])
    for dtype in ("uint16", "uint32"):
        ids = fx.tokens_bin(tmp_path / f"t{dtype}.bin", dtype=dtype)
        b = task(gpt2, ids, token_dtype=dtype).micro_batch(1, 1, 4, 1.0)
        assert b.inputs.shape == (4, 16)


@pytest.mark.parametrize("name, content, message", [
    ("a.tsv", "text\tlabel\ngood\t1\n", "a.tsv:1: no column 'sentence'"),
    ("a.tsv", "sentence\tlabel\ngood\t1\nbad\tx\n", "a.tsv:3: label 'x' is not an integer"),
    ("a.tsv", "sentence\tlabel\ngood\t7\n", "a.tsv:2: label 7 is out of range [0, 3)"),
    ("a.tsv", "sentence\tlabel\ngood\t1\nbad\n", "a.tsv:3: 1 fields, the header has 2"),
    ("a.tsv", "", "a.tsv: the file is empty"),
    ("a.tsv", b"sentence\tlabel\ngood \xff\t1\n", "a.tsv:2: not UTF-8"),
    ("a.jsonl", '{"text": "good", "label": 1}\n{"text": \n',  # (the column of its own line)
     "a.jsonl:2: not a JSON object (Expecting value: line 1 column 10"),
    ("a.jsonl", '{"label": 1}\n', 'a.jsonl:1: needs a "text" string'),
    ("a.jsonl", '{"text": "good"}\n', 'a.jsonl:1: needs a "label"'),
    ("a.tsv", "sentence\tlabel\n \t1\n", "a.tsv:2: empty text"),
    ("a.json", '{\n "data": [\n  {"text": "good", "label": 1}\n ]\n}\n',
     "a.json: one JSON object (keys: data), not a record a line or an array of records"),
    ("a.csv", 'sentence,label\n"good\nmovie",1\n"bad",x\n', "a.csv:4: label 'x'"),
    ("a.tsv", "\ufeffsentence\tlabel\ngood\t9\n", "a.tsv:2: label 9 is out of range"),
])
def test_bad_files_are_refused_with_their_line(models, tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError) as e:
        task(models["bert"], path)
    assert message in str(e.value)


def test_a_folder_given_as_data_is_said_to_be_one(models, tmp_path):
    from worker.inputs import input_problems

    with pytest.raises(DataError, match="a folder; give one file"):
        task(models["bert"], tmp_path)
    assert input_problems(ModelConfig(), DataConfig(eval_data=str(tmp_path))) == [
        f"--eval-data {tmp_path}: a folder; give one file"]


def test_data_too_short_or_of_another_objective_is_named(models, tmp_path):
    """Both said what was wrong but not of which file (the training data or the eval data)."""
    (tmp_path / "short.txt").write_text("good movie\n")
    with pytest.raises(DataError, match=r"short.txt: \d+ tokens in all, fewer than the 17 of "
                       "one --seq-len 16 sample"):
        task(models["gpt2"], tmp_path / "short.txt")
    (tmp_path / "long.txt").write_text("the movie was good and the story was fine\n" * 20)
    with pytest.raises(ValueError, match="long.txt: task text produces lm targets"):
        task(models["bert"], tmp_path / "long.txt")


def test_a_language_model_sample_needs_two_tokens(models, tmp_path):
    (tmp_path / "lm.jsonl").write_text('{"text": "the movie was good"}\n{"text": "good"}\n')
    with pytest.raises(ValueError, match="lm.jsonl:2: 1 token"):
        task(models["gpt2"], tmp_path / "lm.jsonl")


def test_bad_token_files_are_refused(models, tmp_path):
    ids = np.array([5, 6, 7, 8, 9, 999], dtype=np.uint16)
    ids.tofile(tmp_path / "a.bin")
    with pytest.raises(DataError, match="token 5 is id 999, beyond the vocabulary of 41"):
        task(models["gpt2"], tmp_path / "a.bin")
    (tmp_path / "b.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(DataError, match="not a whole number of uint16"):
        task(models["gpt2"], tmp_path / "b.bin")
    with pytest.raises(DataError, match="token ids train a language model"):
        task(models["bert"], tmp_path / "a.bin")


def test_a_labelled_table_for_a_language_model_says_what_it_is(models, tmp_path):
    """It said "label 2 is out of range [0, 2)" (a causal LM config's default num_labels);
    labelled JSONL records and Parquet rows trained the language model on the text and
    dropped the labels without a word (--label-column '' says that is meant)."""
    tsv = fx.classification_tsv(tmp_path / "a.tsv")
    with pytest.raises(DataError, match="a TSV file is labelled text, for a classifier .* "
                       "--classes N makes a causal LM a sequence classifier"):
        task(models["gpt2"], tsv)
    (tmp_path / "a.jsonl").write_text('{"text": "good movie", "label": 1}\n'
                                      '{"text": "bad one", "label": 0}\n')
    with pytest.raises(DataError, match=r"a.jsonl:1: labelled text \('label'\), for a "
                       "classifier: --classes N .* --label-column '' trains the language"):
        task(models["gpt2"], tmp_path / "a.jsonl")
    assert task(models["gpt2"], tmp_path / "a.jsonl", label_column="").n == 2
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": ["good movie", "bad one"], "label": [1, 0]}),
                   tmp_path / "a.parquet")
    with pytest.raises(DataError, match=r"a.parquet: labelled text \('label'\)"):
        task(models["gpt2"], tmp_path / "a.parquet")
    assert task(models["gpt2"], tmp_path / "a.parquet", label_column="").n == 2


def test_tokens_are_cached_and_a_changed_file_is_read_again(models, tmp_path):
    tsv = fx.classification_tsv(tmp_path / "a.tsv")
    first = task(models["bert"], tsv)
    caches = [f for f in os.listdir(tmp_path) if ".l2l-" in f]
    assert len(caches) == 1
    again = task(models["bert"], tsv)
    assert np.array_equal(first.enc.ids, again.enc.ids)
    assert [f for f in os.listdir(tmp_path) if ".l2l-" in f] == caches  # read, not rewritten
    text = tsv.read_text()
    tsv.write_text(text.replace("good", "bad ", 1) if "good" in text else text[::-1])
    assert len(tsv.read_text()) == len(text)  # same size: only the mtime tells
    os.utime(tsv, ns=(10**9, 10**9))
    changed = task(models["bert"], tsv)
    assert not np.array_equal(changed.enc.ids, first.enc.ids)


def test_workers_that_start_together_tokenise_a_file_once(models, tmp_path, monkeypatch):
    """Each worker of a first run tokenised the same file (N x the CPU, on a box whose cores
    the workers share): one does, under a lock beside the cache, the others wait and load."""
    import threading

    from worker.data import files

    tsv = fx.classification_tsv(tmp_path / "a.tsv")
    reads, real = [], files.read_table

    def slow(*args):
        reads.append(1)
        time.sleep(0.5)  # the others arrive meanwhile
        return real(*args)

    monkeypatch.setattr("worker.data.read_table", slow)
    got = [None] * 3

    def run(i):
        got[i] = task(models["bert"], tsv)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(reads) == 1 and all(np.array_equal(g.enc.ids, got[0].enc.ids) for g in got)
    assert [f for f in os.listdir(tmp_path) if f.endswith(".lock")] == []


def test_every_sample_once_per_epoch_in_an_order_of_seed_and_epoch():
    order = Order(10, seed=3, shuffle=True)
    first, second = order(np.arange(0, 10)), order(np.arange(10, 20))
    assert sorted(first) == sorted(second) == list(range(10))
    assert not np.array_equal(first, second)
    assert np.array_equal(Order(10, 3, True)(np.arange(10, 20)), second)  # a pure function
    assert np.array_equal(Order(10, 3, False)(np.arange(5, 15)), np.r_[5:10, 0:5])


def test_a_resumed_run_of_another_batch_shape_takes_the_samples_that_come_next(models,
                                                                                tmp_path):
    """With the origin the EPS gives (16 samples consumed before step 2, by steps of 8), a run
    of steps of 4 samples (1 x 4) trains at steps 2, 3 what the first run's step 2 would have:
    no sample again, none skipped."""
    tsv = fx.classification_tsv(tmp_path / "d.tsv", n=40)
    first = build_task(models["bert"], DataConfig(data=str(tsv)), micro_batch_size=4,
                       global_micro_batches=2)
    then = build_task(models["bert"], DataConfig(data=str(tsv)), micro_batch_size=4,
                      global_micro_batches=1)
    then.origin = (2, 16)
    would = [first.order(first.step_positions(2, i, 4)) for i in range(2)]
    took = [then.order(then.step_positions(s, 0, 4)) for s in (2, 3)]
    assert np.array_equal(np.concatenate(took), np.concatenate(would))
    assert then.loss_terms(3, 4, 1) == 4 and np.array_equal(  # (a classifier: one a sample)
        then.order(then.step_positions(3, 0, 4)), first.order(np.arange(20, 24)))


def test_the_loss_is_normalised_by_the_real_targets_of_the_global_step(models, tmp_path):
    t = task(models["gpt2"], fx.lm_jsonl(tmp_path / "lm.jsonl"))
    batches = Sharder(t, 4, 2).batches(3, range(2))
    real = sum(int((b.targets != -100).sum()) for b in batches)
    assert all(b.norm == real for b in batches)  # both micro-batches: the whole step's count
    assert real < sum(b.inputs.numel() for b in batches)  # padding is not counted


def test_eval_data_is_shared_out_whole(models, tmp_path):
    dev = fx.classification_tsv(tmp_path / "dev.tsv", n=10)
    data = DataConfig(eval_data=str(dev))
    parts = [build_eval(models["bert"], data, 4, rank, 2) for rank in range(2)]
    assert [p.indices for p in parts] == [[0, 2], [1]]  # micro-batches of 4 samples
    sizes = [len(b.targets) for part in parts for b in part.batches()]
    assert sorted(sizes) == [2, 4, 4]
    whole = parts[0].task.batch(np.arange(10), 1.0).targets.tolist()
    got = [t for j in (0, 1, 2) for t in parts[j % 2].task.batch(
        np.arange(j * 4, min(j * 4 + 4, 10)), 1.0).targets.tolist()]
    assert got == whole  # in file order, every sample once
    assert build_eval(models["bert"], DataConfig(), 4, 0, 1) is None


def test_parquet_reads_as_the_text_formats_do(models, tmp_path):
    """A Parquet table (a Hugging Face dataset's file) gives the samples the same rows give as
    TSV (classification, sentence pairs) or as JSONL (text; prompt/completion and messages in
    test_sft)."""
    import csv

    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")

    tsv = fx.classification_tsv(tmp_path / "p.tsv", pairs=True)
    with open(tsv) as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    pq.write_table(pa.table({"sentence1": [r["sentence1"] for r in rows],
                             "sentence2": [r["sentence2"] for r in rows],
                             "label": [int(r["label"]) for r in rows]}), tmp_path / "p.parquet")
    kw = dict(text_column="sentence1", text_pair_column="sentence2")
    a, b = task(models["bert"], tsv, **kw).enc, task(models["bert"], tmp_path / "p.parquet",
                                                     **kw).enc
    assert all(np.array_equal(getattr(a, k), getattr(b, k))
               for k in ("ids", "starts", "types", "labels"))
    lm = fx.lm_jsonl(tmp_path / "lm.jsonl")
    texts = [json.loads(line)["text"] for line in lm.read_text().splitlines()]
    # other columns are left alone ("prompt" without "completion" too)
    pq.write_table(pa.table({"text": texts, "id": list(range(len(texts))),
                             "prompt": ["x"] * len(texts)}), tmp_path / "lm.parquet")
    a, b = task(models["gpt2"], lm).enc, task(models["gpt2"], tmp_path / "lm.parquet").enc
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.starts, b.starts)


def test_bad_parquet_files_are_refused_with_their_row(models, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")

    def refused(model, table, message, **kw):
        path = tmp_path / f"t{len(os.listdir(tmp_path))}.parquet"
        if isinstance(table, bytes):
            path.write_bytes(table)
        else:
            pq.write_table(pa.table(table), path)
        with pytest.raises(DataError, match=message):
            task(model, path, **kw)

    refused(models["bert"], {"text": ["good"], "label": [1]}, r"no column 'sentence' \(columns: "
            "text, label\\)")
    refused(models["bert"], {"sentence": ["good", "bad", None], "label": [1, 0, 1]},
            r"row 3: needs a \"sentence\" string")
    refused(models["bert"], {"sentence": ["good", "bad"], "label": [1, 5]},
            r"row 2: label 5 is out of range \[0, 3\)")
    refused(models["gpt2"], {"body": ["good"]}, "no column text, prompt \\+ completion or "
            "messages")
    refused(models["gpt2"], {"prompt": ["good", "bad"], "completion": ["fine", None]},
            r"row 2: needs \"prompt\" and \"completion\" strings")
    refused(models["gpt2"], b"PAR1 not really", "not a Parquet file")
