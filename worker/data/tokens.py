"""Token ids of a data file, made once with the model's own tokenizer (local files only) and
cached next to the file (``<file>.l2l-<key>.npz``; ``~/.cache/l2l`` when that directory is not
writable). The key covers the data file (path, size, mtime), the tokenizer files and the
options, so a changed file or tokenizer is tokenised (and checked) again, while a later run or
another worker loads the arrays in a fraction of a second.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass

import numpy as np

from .files import Records

log = logging.getLogger("l2l_worker")

CHUNK = 10_000  # texts per tokenizer call


@dataclass
class Encoded:
    """Samples as token ids: sample i is ``ids[starts[i]:starts[i + 1]]``."""

    ids: np.ndarray
    starts: np.ndarray
    types: np.ndarray | None = None  # token type ids (sentence pairs), same layout as ids
    labels: np.ndarray | None = None
    targets: np.ndarray | None = None  # 1 where a token is to be predicted (completions and
    #                                    assistant turns), same layout as ids; None: every one

    def __len__(self) -> int:
        return len(self.starts) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)


def _cache_path(data: str, key: str) -> str:
    name = f"{os.path.basename(data)}.l2l-{key}.npz"
    folder = os.path.dirname(os.path.abspath(data))
    if not os.access(folder, os.W_OK):
        folder = os.path.join(os.path.expanduser("~"), ".cache", "l2l")
        os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, name)


def cache_key(data: str, tokenizer_dir: str, options: tuple) -> str:
    import tokenizers
    import transformers

    st = os.stat(data)
    h = hashlib.sha256(repr((os.path.abspath(data), st.st_size, st.st_mtime_ns, options,
                             transformers.__version__, tokenizers.__version__)).encode())
    for name in sorted(os.listdir(tokenizer_dir)):
        if name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "added_tokens",
                            "chat_template", "config.json")):
            with open(os.path.join(tokenizer_dir, name), "rb") as f:
                h.update(name.encode() + hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:16]


def encode(records: Records, tokenizer, max_length: int | None, min_length: int = 1
           ) -> Encoded:
    """Tokenise every text (and pair), with the tokenizer's special tokens; ``max_length``
    truncates a sample (None: one stream without special tokens, e.g. plain text, tokenised in
    pieces of about a megabyte so that line starts are not word starts); a sample of fewer
    than ``min_length`` tokens is refused by its line."""
    if max_length is None:
        return _stream(records, tokenizer)
    if records.kind != "text":
        enc = (_prompts if records.kind == "prompt" else _chats)(records, tokenizer, max_length)
        return _checked(enc, records, min_length)
    ids, types, starts = [], [], [0]
    pairs = records.pairs
    for lo in range(0, len(records.texts), CHUNK):
        texts = records.texts[lo:lo + CHUNK]
        kw = dict(text_pair=pairs[lo:lo + CHUNK]) if pairs is not None else {}
        out = tokenizer(texts, truncation=True, max_length=max_length,
                        return_attention_mask=False, return_token_type_ids=pairs is not None, **kw)
        for i, seq in enumerate(out["input_ids"]):
            ids.extend(seq)
            starts.append(starts[-1] + len(seq))
            if pairs is not None:
                types.extend(out["token_type_ids"][i])
    enc = Encoded(np.asarray(ids, dtype=np.int32), np.asarray(starts, dtype=np.int64),
                  np.asarray(types, dtype=np.int8) if pairs is not None else None,
                  np.asarray(records.labels, dtype=np.int64) if records.labels else None)
    return _checked(enc, records, min_length)


def _checked(enc: Encoded, records: Records, min_length: int) -> Encoded:
    short = np.flatnonzero(enc.lengths() < min_length)
    if len(short):
        n = int(enc.lengths()[short[0]])
        raise ValueError(f"{records.lines[int(short[0])]}: {n} token(s), fewer than the "
                         f"{min_length} a sample needs")
    if enc.targets is not None:
        lengths = enc.lengths()
        empty = np.flatnonzero(target_counts(enc) == 0)
        if len(empty):
            log.warning("%d of %d samples (the first at line %d) keep no target token within "
                        "--seq-len %d tokens: they train nothing", len(empty), len(lengths),
                        records.lines[int(empty[0])], int(lengths.max()))
    return enc


def target_counts(enc: Encoded) -> np.ndarray:
    """Per sample, the tokens to be predicted (a sample's first token never is)."""
    if enc.targets is None:
        return enc.lengths() - 1
    firsts = enc.starts[:-1]
    return np.add.reduceat(enc.targets.astype(np.int64), firsts) - enc.targets[firsts]


def _joined(samples: list[tuple[list[int], list[int]]], max_length: int) -> Encoded:
    """(token ids, target flags) per sample, each cut to ``max_length``."""
    starts = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum([min(len(ids), max_length) for ids, _ in samples], out=starts[1:])
    ids = np.empty(starts[-1], dtype=np.int32)
    targets = np.empty(starts[-1], dtype=np.int8)
    for k, (seq, flags) in enumerate(samples):
        ids[starts[k]:starts[k + 1]] = seq[:max_length]
        targets[starts[k]:starts[k + 1]] = flags[:max_length]
    return Encoded(ids, starts, targets=targets)


def _prompts(records: Records, tokenizer, max_length: int) -> Encoded:
    """Prompt (with the tokenizer's special tokens), then completion and end-of-text, each
    tokenised apart (as a prompt ends when generation starts); only the completion and the
    end-of-text token are targets. Cut at ``max_length`` from the end."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    samples = []
    for lo in range(0, len(records.texts), CHUNK):
        prompts = tokenizer(records.texts[lo:lo + CHUNK], return_attention_mask=False)
        completions = tokenizer(records.completions[lo:lo + CHUNK], add_special_tokens=False,
                                return_attention_mask=False)
        for p, c in zip(prompts["input_ids"], completions["input_ids"]):
            samples.append((p + c + eos, [0] * len(p) + [1] * (len(c) + len(eos))))
    return _joined(samples, max_length)


def _chats(records: Records, tokenizer, max_length: int) -> Encoded:
    """Each conversation rendered by the tokenizer's chat template and tokenised once; the
    tokens of each assistant turn (what the template renders after the generation prompt, up to
    the end of that turn) are targets. The template must render each conversation's prefix as
    a prefix of the whole, as generation does; a template that does not is refused."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(" messages need a chat template, and the model's tokenizer has none "
                         "(add chat_template.jinja, or use prompt/completion records)")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(" messages need a fast tokenizer (tokenizer.json: character offsets "
                         "mark the assistant turns)")

    def render(messages, prompt=False) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=prompt)

    samples = []
    for line, chat in zip(records.lines, records.chats):
        text, spans = render(chat), []
        for i, m in enumerate(chat):
            if m["role"] != "assistant":
                continue
            before, through = render(chat[:i], True), render(chat[:i + 1])
            if not (text.startswith(before) and text.startswith(through)):
                raise ValueError(f"{line}: the chat template does not render the conversation "
                                 f"up to message {i} as a prefix of the whole; its assistant "
                                 "turns cannot be told apart")
            spans.append((len(before), len(through)))
        out = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True,
                        return_attention_mask=False)
        flags = [int(any(a <= lo < b for a, b in spans)) for lo, _ in out["offset_mapping"]]
        samples.append((out["input_ids"], flags))
    return _joined(samples, max_length)


def _stream(records: Records, tokenizer, piece: int = 1 << 20) -> Encoded:
    ids, text, size = [], [], 0
    for line in records.texts + [None]:
        if line is not None:
            text.append(line)
            size += len(line)
        if text and (line is None or size >= piece):
            ids.extend(tokenizer("".join(text), add_special_tokens=False,
                                 return_attention_mask=False)["input_ids"])
            text, size = [], 0
    return Encoded(np.asarray(ids, dtype=np.int32), np.asarray([0, len(ids)], dtype=np.int64))


def cached_encode(data: str, records_fn, tokenizer, tokenizer_dir: str,
                  max_length: int | None, options: tuple, min_length: int = 1) -> Encoded:
    """``encode(records_fn(), ...)`` through the cache (records_fn validates the file)."""
    path = _cache_path(data, cache_key(data, tokenizer_dir, (max_length, min_length,
                                                               *options)))
    if os.path.isfile(path):
        with np.load(path) as z:
            return Encoded(*(z[k] if k in z else None for k in ("ids", "starts", "types",
                                                                  "labels", "targets")))
    t0 = time.perf_counter()
    records = records_fn()
    try:
        enc = encode(records, tokenizer, max_length, min_length)
    except ValueError as e:
        raise ValueError(f"{data}:{e}") from None
    seconds = time.perf_counter() - t0
    log.info("tokenised %s: %d lines, %d tokens in %.1f s (%.0f s per million lines); cached "
             "in %s", data, len(records.texts), len(enc.ids), seconds,
             seconds / max(1, len(records.texts)) * 1e6, path)
    arrays = {"ids": enc.ids, "starts": enc.starts}
    if enc.types is not None:
        arrays["types"] = enc.types
    for name in ("labels", "targets"):
        if getattr(enc, name) is not None:
            arrays[name] = getattr(enc, name)
    tmp = f"{path}.tmp-{os.getpid()}.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)  # atomic: workers may write the same cache at once
    return enc
