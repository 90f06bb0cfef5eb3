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


def lm_model(tmp_path, template: str | None = CHAT, seq_len: int = SEQ, bpe: tuple = ()):
    """The tiny GPT-2 with ``template``; ``bpe``: (special tokens, end-of-text) of a byte-level
    BPE tokenizer in place of the word-level one."""
    path = fx.model_dir(tmp_path / "model", "gpt2", n_positions=max(64, seq_len))
    if bpe:
        fx.bpe_tokenizer(path, *bpe)
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
    assert "a step takes 8 samples (every worker's micro-batches), the data holds 2" in \
        caplog.text  # 4 x 2 of 2 samples
    none = jsonl(tmp_path / "none.jsonl", [{"prompt": long, "completion": "bad"}])
    with pytest.raises(DataError, match="no sample keeps a token to predict"):
        task(model, none)  # all loss terms 0: refused, not trained (or evaluated) as loss 0


# as Phi-3's: the end-of-text token closes the whole conversation only
PHI3 = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% else %}<|endoftext|>{% endif %}")
# as ChatML (Qwen), and as Qwen3's: an empty thinking block opens only the assistant turns
# after the last user message, so a conversation's prefix is not rendered as a prefix
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN3 = ("{% set last = namespace(i=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
         "{% set last.i = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}"
         "<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and loop.index0 > last.i %}"
         "<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


# as Llama 3's and Gemma's: contents trimmed
TRIMMED = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}"
           "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
           "{% endif %}")


@pytest.mark.parametrize("template, eos, closing, last", [
    (CHAT, "[SEP]", " [SEP] ", " [SEP] "),
    (TRIMMED, "<|im_end|>", "<|im_end|>\n", "<|im_end|>\n"),
    (CHATML, "<|im_end|>", "<|im_end|>\n", "<|im_end|>\n"),
    (QWEN3, "<|im_end|>", "<|im_end|>\n", "<|im_end|>\n"),
    (PHI3, "<|endoftext|>", "<|end|>\n", "<|end|>\n<|endoftext|>")])
def test_chat_templates_of_real_models_with_a_byte_level_tokenizer(tmp_path, template, eos,
                                                                    closing, last):
    """Two assistant turns after a system and two user turns: the targets decode to exactly the
    assistant contents and the template's closing of each turn (the end-of-text token that
    Phi-3 writes after the last), also where a word's token carries the space before it (CHAT)
    and where the template does not render a conversation's prefix as a prefix (Qwen3)."""
    specials = ["[SEP]", "<|im_start|>", "<|im_end|>", "<|system|>", "<|user|>", "<|assistant|>",
                "<|end|>", "<|endoftext|>", "<think>", "</think>"]
    model = lm_model(tmp_path, template, seq_len=96, bpe=(specials, eos))
    tok = model.tokenizer()
    chat = [{"role": "system", "content": "be"},
            {"role": "user", "content": "good "},
            {"role": "assistant", "content": "great music"},
            {"role": "user", "content": "and"},
            {"role": "assistant", "content": "fine" if template != TRIMMED else " fine\n"}]
    t = task(model, jsonl(tmp_path / "chat.jsonl", [{"messages": chat}] * 8))
    for row in t.micro_batch(0, 0, 4, 1.0).targets:
        got = tok.decode([int(i) for i in row if i != -100])
        if template == CHAT:  # "assistant great": the first word's token brings its space
            got, closing, last = (" ".join(x.split()) for x in (got, closing, last))
            assert got == f"great music {closing} fine {last}"
        else:
            assert got == f"great music{closing}fine{last}"


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
    # a template that renders contents by what they say: the turns cannot be located
    ('\n{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": '
     '"b"}]}\n', "{% for m in messages %}{% if 'b' in m['content'] %}B {% endif %}"
     "{{ m['content'] }} {% endfor %}", "x.jsonl:2: the chat template: the chat template "
     "renders this conversation differently by its contents"),
    ('{"messages": [{"role": "system", "content": "a"}, {"role": "assistant", "content": '
     '"b"}]}\n', "{% for m in messages %}{% if m['role'] != 'system' %}{{ m['content'] }}"
     "{% endif %}{% endfor %}", "x.jsonl:1: the chat template: the chat template leaves out "
     "or alters message 0"),
    ('{"messages": [{"role": "system", "content": "a"}, {"role": "assistant", "content": '
     '"b"}]}\n', "{{ raise_exception('no system role') }}",
     "x.jsonl:1: the chat template: no system role"),
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


def test_a_prompt_keeps_the_tokens_a_text_starts_with_but_not_those_it_ends_with(tmp_path):
    """A tokenizer that wraps a text ("[CLS] text [SEP]") starts the prompt with "[CLS]" and
    does not end it with "[SEP]": the sample is [CLS] prompt completion [SEP]."""
    from worker.data.files import Records
    from worker.data.sft import prompt_samples

    path = tmp_path / "tok"
    path.mkdir()
    tok = fx.tokenizer(path, "bert")
    tok.eos_token = "[SEP]"
    records = Records(["the movie"], None, None, [1], kind="prompt", completions=["was good"])
    [(ids, flags)] = prompt_samples(records, tok)
    words = tok.convert_ids_to_tokens(ids)
    assert words == ["[CLS]", "the", "movie", "was", "good", "[SEP]"]
    assert flags == [0, 0, 0, 1, 1, 1]


def test_a_json_array_of_records_reads_as_jsonl(tmp_path):
    """A .json file holding one array of records gives the samples its lines would; a bad
    record is named by its number."""
    model = lm_model(tmp_path)
    records = [{"prompt": p, "completion": c} for p, c in
               zip(fx.sentences(6, seed=1), fx.sentences(6, seed=2))]
    lines = task(model, jsonl(tmp_path / "a.jsonl", records)).enc
    (tmp_path / "a.json").write_text(json.dumps(records, indent=1))
    array = task(model, str(tmp_path / "a.json")).enc
    assert all(np.array_equal(getattr(lines, k), getattr(array, k))
               for k in ("ids", "starts", "targets"))
    (tmp_path / "b.json").write_text(json.dumps(records[:2] + [{"prompt": "x"}]))
    with pytest.raises(DataError, match=r"b.json: record 3: needs \"prompt\" and"):
        task(model, str(tmp_path / "b.json"))
    (tmp_path / "c.json").write_text('[{"text": "good"},')
    with pytest.raises(DataError, match="c.json: not a JSON array"):
        task(model, str(tmp_path / "c.json"))
