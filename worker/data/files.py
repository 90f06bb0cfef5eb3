"""Reading data files, with every problem refused before training starts: the file, the line
and the reason (a missing column, a label that is not an integer in range, an empty file,
undecodable text).

    tsv, csv   GLUE layout: a header, a text column, optionally a second text column (sentence
               pairs) and an integer label column
    jsonl      one object per line (or a JSON array of them): {"text": ..., "label": int}
               (classification), or, for language modelling, {"text": ...} (every token a
               target), {"prompt": ..., "completion": ...} (targets: the completion) or
               {"messages": [{"role": ..., "content": ...}, ...]} (the model's chat template;
               targets: assistant turns), one kind per file
    parquet    a table: the columns of tsv (classification) or the keys of jsonl records
    txt        plain text (language modelling), one stream
    tokens     token ids as raw uint16/uint32 (nanoGPT's .bin), memory-mapped
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from dataclasses import dataclass

import numpy as np

# A field as long as a document: the text is cut to --seq-len once tokenised, not here
csv.field_size_limit(2**31 - 1)
FORMATS = {".tsv": "tsv", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl", ".txt": "txt",
           ".bin": "tokens", ".parquet": "parquet"}


class DataError(ValueError):
    """A data file that cannot be trained on; the message names the file and the line."""


@dataclass
class Records:
    """Texts (and pairs and labels) read from a file, with their line numbers. ``kind`` "text":
    every token of a text is a target; "prompt": ``texts`` are prompts, the targets are their
    ``completions``; "chat": ``chats`` are conversations (``texts`` holds each one's first
    message), the targets are the assistant turns."""

    texts: list[str]
    pairs: list[str] | None
    labels: list[int] | None
    lines: list[int]
    kind: str = "text"
    completions: list[str] | None = None
    chats: list[list[dict]] | None = None
    unit: str = "line"  # what ``lines`` number: the file's lines, a table's rows (Parquet) or
    #                     the records of a JSON array

    def where(self, k: int) -> str:
        """Sample k's place in the file, e.g. "line 12", "row 12" or "record 12"."""
        return f"{self.unit} {self.lines[k]}"

    def at(self, k: int) -> str:
        """Sample k's place after the file's name in an error: ":12" or ": row 12"."""
        return f":{self.lines[k]}" if self.unit == "line" else f": {self.where(k)}"


def data_format(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise DataError(f"{path}: cannot tell the format from {ext!r}; give --data-format "
                        f"({', '.join(sorted(set(FORMATS.values())))})")
    return FORMATS[ext]


def _lines(path: str):
    """(line number, text) of a UTF-8 file (a byte-order mark is dropped); an undecodable line
    is refused by number."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{number}: not UTF-8 text ({e.reason} at byte "
                                f"{e.start})") from None


def _label(where: str, value, classes: int) -> int:
    """``where``: the file and line (or row) named in an error."""
    if isinstance(value, int) and not isinstance(value, bool):
        label = value
    elif isinstance(value, str) and re.fullmatch(r"\s*-?\d+\s*", value):
        label = int(value)
    else:
        raise DataError(f"{where}: label {value!r} is not an integer")
    if not 0 <= label < classes:
        raise DataError(f"{where}: label {label} is out of range [0, {classes})")
    return label


def _text(where: str, text, name: str = "text") -> str:
    if not isinstance(text, str):
        raise DataError(f"{where}: needs a \"{name}\" string")
    if not text.strip():
        raise DataError(f"{where}: empty text")
    return text


def _labelled(out: Records, where: str, number: int, text, pair, label, classes: int,
              names: tuple[str, str] = ("text", "text")) -> None:
    """Add one classification sample (``pair`` None: no second text) to ``out``."""
    out.texts.append(_text(where, text, names[0]))
    if out.pairs is not None:
        out.pairs.append(_text(where, pair, names[1]))
    out.labels.append(_label(where, label, classes))
    out.lines.append(number)


def read_table(path: str, fmt: str, text: str, pair: str, label: str, classes: int) -> Records:
    """A GLUE-layout TSV/CSV file."""
    lines = [t for _, t in _lines(path)]  # checks the encoding line by line
    if not lines:
        raise DataError(f"{path}: the file is empty")
    reader = csv.reader(io.StringIO("".join(lines)), delimiter="\t" if fmt == "tsv" else ",",
                        quoting=csv.QUOTE_NONE if fmt == "tsv" else csv.QUOTE_MINIMAL)
    try:  # (each row with its last line: a quoted field may span lines)
        rows = [(reader.line_num, row) for row in reader]
    except csv.Error as e:
        raise DataError(f"{path}:{reader.line_num}: {e}") from None
    (_, header), rows = rows[0], rows[1:]
    columns = {name: i for i, name in enumerate(header)}
    for name in (text, label, *([pair] if pair else [])):
        if name not in columns:
            raise DataError(f"{path}:1: no column {name!r} in the header "
                            f"({', '.join(header)})")
    out = Records([], [] if pair else None, [], [])
    for number, row in rows:
        if not row or row == [""]:
            continue
        if len(row) != len(header):
            raise DataError(f"{path}:{number}: {len(row)} fields, the header has {len(header)}")
        _labelled(out, f"{path}:{number}", number, row[columns[text]],
                  row[columns[pair]] if pair else None, row[columns[label]], classes)
    if not out.texts:
        raise DataError(f"{path}: no rows after the header")
    return out


JSONL_KINDS = {"text": "a \"text\" string", "prompt": "\"prompt\" and \"completion\" strings",
               "chat": "a \"messages\" list"}


def _jsonl_kind(obj: dict) -> str | None:
    if "messages" in obj:
        return "chat"
    if "prompt" in obj or "completion" in obj:
        return "prompt"
    return "text" if "text" in obj else None


def _messages(where: str, messages) -> list[dict]:
    """A conversation: {"role": str, "content": str} objects, at least one assistant turn
    with content."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: \"messages\" must be a non-empty list")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: message {i} needs \"role\" and \"content\" strings")
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        raise DataError(f"{where}: no assistant message with content (nothing to train on)")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _jsonl_rows(path: str):
    first = True
    for number, line in _lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line.rstrip("\r\n"))  # (a column of this line, not of the next)
        except ValueError as e:
            if first and isinstance(whole := _whole(path), dict):  # one object, indented
                raise DataError(f"{path}: one JSON object (keys: {', '.join(list(whole)[:5])})"
                                ", not a record a line or an array of records") from None
            raise DataError(f"{path}:{number}: not a JSON object ({e})") from None
        first = False
        yield f"{path}:{number}", number, obj


def _whole(path: str):
    """The file as one JSON value, or None."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8-sig"))
    except (OSError, ValueError):
        return None


def _array_rows(path: str):
    """A JSON file holding one array of records (what some datasets are saved as)."""
    try:
        with open(path, "rb") as f:
            records = json.loads(f.read().decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except ValueError as e:
        raise DataError(f"{path}: not a JSON array ({e})") from None
    if not isinstance(records, list):
        raise DataError(f"{path}: not a JSON array")
    for number, obj in enumerate(records, 1):
        yield f"{path}: record {number}", number, obj


def _starts_an_array(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def labelled_for_lm(label: str) -> str:
    return (f"labelled text ({label!r}), for a classifier: --classes N makes a causal LM a "
            "sequence classifier with a new head; --label-column '' trains the language model "
            "on the text alone")


def read_jsonl(path: str, classes: int | None, label: str = "label") -> Records:
    """``classes`` None: language modelling (text, prompt/completion or messages records, one
    kind per file; a text record with a ``label`` is refused); else ``text`` and ``label`` are
    required. One record per line, or a JSON array of records (numbered from 1)."""
    if _starts_an_array(path):
        out = read_records(path, _array_rows(path), classes, label)
        out.unit = "record"
        return out
    return read_records(path, _jsonl_rows(path), classes, label)


def read_records(path: str, rows, classes: int | None, label: str = "") -> Records:
    """Records of (where, number, object) rows: JSONL lines, or Parquet rows as objects (a
    language model's text record with a ``label`` key is refused)."""
    out = Records([], None, [] if classes else None, [])
    first = None
    for where, number, obj in rows:
        kind = _jsonl_kind(obj) if isinstance(obj, dict) else None
        if classes and kind in ("prompt", "chat"):
            raise DataError(f"{where}: {kind} records train a language model, not a "
                            "classifier")
        if kind is None:
            wanted = JSONL_KINDS["text"] if classes else " or ".join(JSONL_KINDS.values())
            raise DataError(f"{where}: needs {wanted}")
        if first is None:
            first = out.kind = kind
            if kind == "prompt":
                out.completions = []
            elif kind == "chat":
                out.chats = []
        elif kind != first:
            raise DataError(f"{where}: a {kind} record in a file of {first} records (one kind "
                            "per file)")
        if kind == "text":
            if classes is None and label and label in obj:
                raise DataError(f"{where}: {labelled_for_lm(label)}")
            out.texts.append(_text(where, obj["text"]))
        elif kind == "prompt":
            if not (isinstance(obj.get("prompt"), str) and isinstance(obj.get("completion"),
                                                                      str)):
                raise DataError(f"{where}: needs {JSONL_KINDS['prompt']}")
            out.texts.append(obj["prompt"])
            out.completions.append(_text(where, obj["completion"]))
        else:
            out.chats.append(_messages(where, obj["messages"]))
            out.texts.append(out.chats[-1][0]["content"])
        if classes:
            if "label" not in obj:
                raise DataError(f"{where}: needs a \"label\"")
            out.labels.append(_label(where, obj["label"], classes))
        out.lines.append(number)
    if not out.texts:
        raise DataError(f"{path}: the file is empty")
    return out


def read_parquet(path: str, classes: int | None, text: str, pair: str, label: str
                 ) -> Records:
    """A Parquet file (e.g. a Hugging Face dataset's): for a classifier the columns TSV names
    (--text-column, --text-pair-column, --label-column); for a language model the keys JSONL
    records have (text, prompt + completion, or messages). Errors name the row (from 1)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several kinds for a file that is not Parquet
        raise DataError(f"{path}: not a Parquet file ({e})") from None
    names = table.schema_arrow.names
    if classes:
        wanted = [text, label, *([pair] if pair else [])]
    else:  # the columns of one kind of record, as a row of JSONL would have them
        kinds = (["messages"], ["prompt", "completion"], ["text"])
        wanted = next((k for k in kinds if set(k) <= set(names)), [])
        if not wanted:
            raise DataError(f"{path}: no column text, prompt + completion or messages "
                            f"(columns: {', '.join(names)})")
        if wanted == ["text"] and label and label in names:
            raise DataError(f"{path}: {labelled_for_lm(label)}")
    for name in wanted:
        if name not in names:
            raise DataError(f"{path}: no column {name!r} (columns: {', '.join(names)})")

    def rows():
        number = 0
        for batch in table.iter_batches(batch_size=4096, columns=wanted):
            for row in batch.to_pylist():
                number += 1
                yield f"{path}: row {number}", number, row

    if not classes:
        out = read_records(path, rows(), None)
        out.unit = "row"
        return out
    out = Records([], [] if pair else None, [], [], unit="row")
    for where, number, row in rows():
        _labelled(out, where, number, row[text], row[pair] if pair else None, row[label],
                  classes, (text, pair))
    if not out.texts:
        raise DataError(f"{path}: the file is empty")
    return out


def read_text(path: str) -> Records:
    """Plain text: one stream, kept as lines (their newlines included)."""
    out = Records([], None, None, [])
    for number, line in _lines(path):
        out.texts.append(line)
        out.lines.append(number)
    if not "".join(out.texts).strip():
        raise DataError(f"{path}: the file is empty")
    return out


def read_tokens(path: str, dtype: str, vocab: int) -> np.ndarray:
    """Token ids, memory-mapped; every id must be below ``vocab``."""
    size = os.path.getsize(path)
    item = np.dtype(dtype).itemsize
    if size == 0:
        raise DataError(f"{path}: the file is empty")
    if size % item:
        raise DataError(f"{path}: {size} bytes is not a whole number of {dtype} token ids")
    ids = np.memmap(path, dtype=dtype, mode="r")
    for start in range(0, len(ids), 1 << 24):  # in chunks: a large file is never read whole
        chunk = ids[start:start + (1 << 24)]
        bad = np.flatnonzero(chunk >= vocab)
        if len(bad):
            at = start + int(bad[0])
            raise DataError(f"{path}: token {at} is id {int(ids[at])}, beyond the vocabulary "
                            f"of {vocab}")
    return ids
