"""Supervised fine-tuning data: prompt/completion records train on the completion only, chat
records (the model's chat template) on the assistant turns only; every target is checked
against the tokenizer called directly, and each bad file or template is refused."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from worker.config import DataConfig, ModelConfig
from worker.data import DataError, build_task
from worker.models import build_model

transformers = pytest.importorskip("transformers")
from . import hf_fixtures as fx  # noqa: E402  (needs transformers)

SEQ = 24
# roles in front of each turn; the generation prompt opens an assistant turn
CHAT = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} [SEP] {% endfor %}"
        "{% if add_generation_prompt %}assistant {% endif %}")


def lm_model(tmp_path, template: str | None = CHAT, seq_len: int = SEQ):
    path = fx.model_dir(tmp_path / "model", "gpt2")
    if template is not None:
        tok = transformers.AutoTokenizer.from_pretrained(str(path))
        tok.chat_template = template
        tok.save_pretrained(str(path))
    return build_model(ModelConfig(model=f"hf:{path}", seq_len=seq_len))


def jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def task(model, path):
    return build_task(model, DataConfig(data=path), micro_batch_size=4, global_micro_batches=2)


def target_rows(batch) -> list[list[tuple[int, int]]]:
    """(position, target id) of every real target, per row."""
    return [[(t, int(row[t])) for t in range(len(row)) if row[t] != -100]
            for row in batch.targets]


def test_prompt_completion_trains_on_the_completion_only(tmp_path):
    model = lm_model(tmp_path, None)
    tok = model.tokenizer()
    records = [{"prompt": p, "completion": c} for p, c in
               zip(fx.sentences(8, seed=1), fx.sentences(8, seed=2))]
    t = task(model, jsonl(tmp_path / "sft.jsonl", records))
    for index in range(2):
        b = t.micro_batch(0, index, 4, 1.0)
        for k, row, got in zip(t.order(t.step_positions(0, index, 4)), b.inputs,
                               target_rows(b)):
            prompt = tok(records[k]["prompt"])["input_ids"]
            completion = tok(records[k]["completion"],
                             add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            assert row[:len(prompt)].tolist() == prompt
            n = len(prompt)  # position n-1 predicts the first completion token
            assert got == [(n - 1 + j, c) for j, c in enumerate(completion)]
    # the normaliser counts completion tokens (and end-of-text) only
    assert t.loss_terms(0, 4, 2) == sum(
        len(tok(records[k]["completion"], add_special_tokens=False)["input_ids"]) + 1
        for k in t.order(t.step_positions(0, 0, 8)))


def test_chat_trains_on_the_assistant_turns_only(tmp_path):
    """Two assistant turns per conversation: the targets are exactly their words and the end
    of each turn; the system and user turns, the roles and the generation prompt are not."""
    model = lm_model(tmp_path, seq_len=48)  # whole conversations
    tok = model.tokenizer()
    said = fx.sentences(16, seed=3, max_words=4)
    chats = [[{"role": "system", "content": "be good"},
              {"role": "user", "content": said[4 * i]},
              {"role": "assistant", "content": said[4 * i + 1]},
              {"role": "user", "content": said[4 * i + 2]},
              {"role": "assistant", "content": said[4 * i + 3]}] for i in range(4)]
    t = task(model, jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in chats]))
    b = t.micro_batch(0, 0, 4, 1.0)
    for k, got in zip(t.order(t.step_positions(0, 0, 4)), target_rows(b)):
        words = " ".join(tok.convert_ids_to_tokens([c for _, c in got]))
        assert words == f"{chats[k][2]['content']} [SEP] {chats[k][4]['content']} [SEP]"
    # the targets survive the token cache, and a Parquet table of the same records (a
    # column of lists of structs) gives the same samples
    again = task(model, str(tmp_path / "chat.jsonl"))
    assert torch.equal(again.micro_batch(0, 0, 4, 1.0).targets, b.targets)
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")

    pq.write_table(pa.table({"messages": chats}), tmp_path / "chat.parquet")
    table = task(model, str(tmp_path / "chat.parquet"))
    assert all(np.array_equal(getattr(table.enc, k), getattr(t.enc, k))
               for k in ("ids", "starts", "targets"))


def test_a_prompt_longer_than_the_sequence_trains_nothing(tmp_path, caplog):
    model = lm_model(tmp_path, None)
    long = " ".join(["good"] * (SEQ + 5))
    path = jsonl(tmp_path / "long.jsonl", [{"prompt": long, "completion": "bad"},
                                           {"prompt": "the", "completion": "good film"}])
    with caplog.at_level(logging.WARNING, logger="l2l_worker"):
        t = task(model, path)
    assert "1 of 2 samples (the first at line 1) keep no target token" in caplog.text
    assert t.targets.tolist() == [0, 3]


@pytest.mark.parametrize("content, template, message", [
    ('{"prompt": "a", "completion": "b"}\n{"text": "c"}\n', CHAT,
     "x.jsonl:2: a text record in a file of prompt records"),
    ('{"prompt": "a"}\n', CHAT, 'x.jsonl:1: needs "prompt" and "completion" strings'),
    ('{"prompt": "a", "completion": " "}\n', CHAT, "x.jsonl:1: empty text"),
    ('{"messages": [{"role": "user", "content": "a"}]}\n', CHAT,
     "x.jsonl:1: no assistant message with content"),
    ('{"messages": [{"role": "user"}]}\n', CHAT, 'x.jsonl:1: message 0 needs "role"'),
    ('{"messages": []}\n', CHAT, "x.jsonl:1: \"messages\" must be a non-empty list"),
    ('{"label": 1}\n', CHAT, 'x.jsonl:1: needs a "text" string or "prompt" and'),
    ('{"messages": [{"role": "assistant", "content": "a"}]}\n', None,
     "x.jsonl: messages need a chat template"),
    # renders the last message apart: a conversation's prefix is not a prefix of the whole
    ('\n{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": '
     '"b"}]}\n', "{% for m in messages %}{% if loop.last %}last {% endif %}{{ m['content'] }} "
     "{% endfor %}", "x.jsonl:2: the chat template does not render the conversation up to "
     "message 1 as a prefix"),
])
def test_bad_records_are_refused_by_line(tmp_path, content, template, message):
    model = lm_model(tmp_path, template)
    (tmp_path / "x.jsonl").write_text(content)
    with pytest.raises(DataError if "template" not in message else ValueError, match=message):
        task(model, str(tmp_path / "x.jsonl"))


def test_a_classifier_refuses_language_model_records(tmp_path):
    bert = build_model(ModelConfig(model=f"hf:{fx.model_dir(tmp_path / 'bert', 'bert')}",
                                   seq_len=SEQ))
    (tmp_path / "x.jsonl").write_text('{"prompt": "a", "completion": "b", "label": 1}\n')
    with pytest.raises(DataError, match="x.jsonl:1: prompt records train a language model"):
        task(bert, str(tmp_path / "x.jsonl"))
