"""Token ids of a data file, made once with the model's own tokenizer (local files only) and
cached next to the file (``<file>.l2l-<key>.npz``; ``~/.cache/l2l`` when that directory is not
writable). The key covers the data file (path, size, mtime), the tokenizer files and the
options, so a changed file or tokenizer is tokenised (and checked) again, while a later run or
another worker loads the arrays in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import time
from dataclasses import dataclass

import numpy as np

from .files import Records
from .sft import CHUNK, chat_samples, prompt_samples

log = logging.getLogger("l2l_worker")

FORMAT = 3  # of the cached arrays: a cache of another format is made again (3: read again
#             where the checks of a file changed: labelled records for a language model)


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
    h = hashlib.sha256(repr((FORMAT, os.path.abspath(data), st.st_size, st.st_mtime_ns,
                             options, transformers.__version__, tokenizers.__version__)).encode())
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
        samples = (prompt_samples if records.kind == "prompt" else chat_samples)(records,
                                                                                tokenizer)
        enc = _joined(samples, max_length)
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
        raise ValueError(f"{records.at(int(short[0]))}: {n} token(s), fewer than the "
                         f"{min_length} a sample needs")
    if enc.targets is not None:
        lengths = enc.lengths()
        empty = np.flatnonzero(target_counts(enc) == 0)
        if len(empty):
            log.warning("%d of %d samples (the first at %s) keep no target token within "
                        "--seq-len %d tokens: they train nothing", len(empty), len(lengths),
                        records.where(int(empty[0])), int(lengths.max()))
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
        return _load(path)
    # One process of the box tokenises (workers start together); the others wait, then load.
    with _locked(f"{path}.lock"):
        if os.path.isfile(path):
            return _load(path)
        return _encode_into(path, data, records_fn, tokenizer, max_length, min_length)


def _load(path: str) -> Encoded:
    with np.load(path) as z:
        return Encoded(*(z[k] if k in z else None for k in ("ids", "starts", "types", "labels",
                                                              "targets")))


@contextlib.contextmanager
def _locked(path: str):
    """An exclusive flock on ``path`` (nothing where the file system has no locks); the file
    is removed after: a process that comes later finds the cache before it looks for it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)
        os.close(fd)


def _encode_into(path: str, data: str, records_fn, tokenizer, max_length: int | None,
                 min_length: int) -> Encoded:
    t0 = time.perf_counter()
    records = records_fn()
    try:
        enc = encode(records, tokenizer, max_length, min_length)
    except ValueError as e:  # the message starts with the sample's place (Records.at)
        raise ValueError(f"{data}{e}") from None
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
