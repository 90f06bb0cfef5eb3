"""What a model trains on, sharded by global micro-batch index.

Every micro-batch is a pure function of (seed, step, global micro-batch index): worker r with u
micro-batches per step takes global indices [r*u, (r+1)*u), so N workers together see exactly
the minibatch one worker with N*u micro-batches sees, and a resumed run sees the same data as
an uninterrupted one. Tasks: the synthetic ``trigger`` and ``markov`` (synthetic.py), and
``text``: a data file (files.py), tokenised and cached (tokens.py), batched (textsets.py).
"""

from __future__ import annotations

import logging
import os
from functools import partial

from ..config import DataConfig
from ..models.base import Batch, LayeredModel
from .files import (
    DataError,
    data_format,
    read_jsonl,
    read_parquet,
    read_table,
    read_text,
    read_tokens,
)
from .synthetic import MarkovTask, TriggerTask
from .textsets import EvalSet, TextTask
from .tokens import Encoded, cached_encode

__all__ = ["Batch", "DataError", "EvalSet", "MarkovTask", "Sharder", "TextTask", "TriggerTask",
           "build_eval", "build_task"]

log = logging.getLogger("l2l_worker")

SYNTHETIC = {"trigger": TriggerTask, "markov": MarkovTask}


def build_task(model: LayeredModel, data: DataConfig | None = None, *,
               micro_batch_size: int = 8, global_micro_batches: int = 1):
    """The task ``data.task`` names (``auto``: text when a data file is given, else the
    model's own), checked against what the model's head trains on."""
    data = data or DataConfig()
    name = data.task
    if name == "auto":
        name = "text" if data.data else model.default_task
    if name == "text":
        if not data.data:
            raise ValueError(f"model {model.cfg.model} trains on text: give --data PATH")
        task = text_task(model, data, data.data, micro_batch_size, global_micro_batches)
        step = micro_batch_size * global_micro_batches
        if step > task.n:
            log.warning("%s: a step takes %d samples (every worker's micro-batches), the data "
                        "holds %d: each is seen about %.0f times a step", data.data, step,
                        task.n, step / task.n)
    else:
        task = SYNTHETIC[name](model.cfg)
    if task.objective != model.objective:
        raise ValueError((f"{data.data}: " if name == "text" else "") +
                         f"task {name} produces {task.objective} targets, but model "
                         f"{model.cfg.model} trains a {model.objective} head")
    return task


def build_eval(model: LayeredModel, data: DataConfig, micro_batch_size: int, rank: int,
               world: int) -> EvalSet | None:
    """This worker's share of ``--eval-data`` (None without it)."""
    if not data.eval_data:
        return None
    task = text_task(model, data, data.eval_data, micro_batch_size, 1, shuffle=False)
    if task.objective != model.objective:
        raise ValueError(f"{data.eval_data}: {task.objective} data for a {model.objective} "
                         "model")
    return EvalSet(task, micro_batch_size, rank, world)


def text_task(model, data: DataConfig, path: str, size: int, count: int,
              shuffle: bool | None = None) -> TextTask:
    """A data file as a task: read and checked, tokenised (cached), ready to batch."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: " + ("a folder; give one file" if os.path.isdir(path) else
                                       "no such file"))
    fmt = data_format(path, data.data_format)
    cfg = model.cfg
    seed, shuffle = cfg.seed, data.shuffle if shuffle is None else shuffle
    if fmt == "tokens":
        if model.objective != "lm":
            raise DataError(f"{path}: token ids train a language model, not a "
                            f"{model.objective} head")
        vocab = getattr(getattr(model, "config", None), "vocab_size", cfg.vocab)
        ids = read_tokens(path, data.token_dtype, vocab)
        return _task(path, Encoded(ids, None), "lm", seed=seed, shuffle=shuffle, pad_id=0,
                     micro_batch_size=size, global_micro_batches=count, window=cfg.seq_len)
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise DataError(f"{path}: text needs the model's tokenizer (an hf: model); a built-in "
                        "model trains on token ids (--data-format tokens)")
    tokenizer = tokenizer()
    classes = getattr(model.config, "num_labels", cfg.classes)
    if fmt in ("tsv", "csv"):
        if model.objective != "classify":  # (its labels were checked against num_labels: 2)
            raise DataError(f"{path}: a {fmt.upper()} file is labelled text, for a classifier "
                            f"({model.cfg.model} trains a language model; --classes N makes a "
                            "causal LM a sequence classifier with a new head); a language model "
                            "trains on plain text, JSONL records or token ids")
        records = partial(read_table, path, fmt, data.text_column, data.text_pair_column,
                          data.label_column, classes)
        objective = "classify"
    elif fmt == "jsonl":
        objective = model.objective
        records = partial(read_jsonl, path, None if objective == "lm" else classes,
                          data.label_column)
    elif fmt == "parquet":
        objective = model.objective
        records = partial(read_parquet, path, None if objective == "lm" else classes,
                          data.text_column, data.text_pair_column, data.label_column)
    else:
        records = partial(read_text, path)
        objective = "lm"
    window = cfg.seq_len if fmt == "txt" else 0
    options = (fmt, data.text_column, data.text_pair_column, data.label_column, classes,
               objective)
    # A language-model sample needs two tokens (an input and its target).
    enc = cached_encode(path, records, tokenizer, model.path, None if window else cfg.seq_len,
                        options, min_length=2 if objective == "lm" else 1)
    task = _task(path, enc, objective, seed=seed, shuffle=shuffle, pad_id=model.pad_id(tokenizer),
                 micro_batch_size=size, global_micro_batches=count, window=window)
    if objective == "lm" and not task.targets.any():  # every loss would be 0 / 0
        raise DataError(f"{path}: no sample keeps a token to predict within --seq-len "
                        f"{cfg.seq_len} (prompts or user turns fill it): nothing to train or "
                        "evaluate on; give a larger --seq-len")
    return task


def _task(path: str, *args, **kw) -> TextTask:
    """TextTask(*args, **kw), its refusal naming the file."""
    try:
        return TextTask(*args, **kw)
    except ValueError as e:
        raise DataError(f"{path}: {e}") from None


class Sharder:
    """The micro-batches of one worker for a step, with the global loss normaliser."""

    def __init__(self, task, micro_batch_size: int, global_micro_batches: int):
        if getattr(task, "count", global_micro_batches) != global_micro_batches or \
                getattr(task, "size", micro_batch_size) != micro_batch_size:
            raise ValueError("the task was built for another batch shape than the sharder's")
        self.task = task
        self.size = micro_batch_size
        self.count = global_micro_batches

    def batches(self, step: int, indices) -> list[Batch]:
        # at least 1: a step whose samples keep no target (prompts cut by --seq-len) adds 0
        norm = float(max(1, self.task.loss_terms(step, self.size, self.count)))
        return [self.task.micro_batch(step, i, self.size, norm) for i in indices]
