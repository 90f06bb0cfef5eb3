"""What l2l-launch shows while a job runs, and where the children's logs go.

- On a terminal: one live progress bar (tqdm): step / total, smoothed loss, accuracy, samples/s,
  ETA, and where the slowest worker's step went (compute, waiting for weights, waiting for push
  acks). Elsewhere (CI, ``| tee``): one plain line every ``every`` steps, and the last one,
  with that step's own loss.
- Children's logs go to ``<run dir>/<name>.log`` (eps.log, w0.log, ...). Only their warnings and
  errors (whole, with the lines that continue them, and tracebacks) reach the console, each
  line prefixed by its process; ``verbose`` shows every line. Launcher messages and
  evaluations are printed above the bar.
- ``table`` formats the final summary.

Called from the launcher's reader threads: one lock orders the output.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import threading
from typing import TextIO

from tqdm import tqdm

# A child's log line worth showing without --verbose (the children log "... LEVEL message"),
# and the lines of a traceback (shown whole: from "Traceback" to its unindented last line).
LOUD = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|^\S*(Error|Exception)\b|^Fatal Python error")
TRACEBACK = re.compile(r"^Traceback \(most recent call last\)")
FATAL = re.compile(r"\b(ERROR|CRITICAL)\b|^\S*(Error|Exception)\b")  # why a child failed
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")  # a log record's first line: its time
SMOOTHING = 0.9  # the bar's loss: an exponential moving average


class Console:
    def __init__(self, total: int, log_dir: str, *, verbose: bool = False, quiet: bool = False,
                 every: int = 10, out: TextIO | None = None, tty: bool | None = None):
        self.total, self.log_dir, self.verbose, self.quiet = total, log_dir, verbose, quiet
        self.every = max(1, every)
        self.out = out or sys.stdout
        self.tty = self.out.isatty() if tty is None else tty
        self._lock = threading.Lock()
        self._files: dict[str, TextIO] = {}
        self._traceback: set[str] = set()  # children in the middle of printing a traceback
        self._loud: set[str] = set()  # children whose last log record is shown (its next
        #                               lines, until a new record, are the rest of it)
        self._loss: float | None = None
        self.errors: dict[str, str] = {}  # each child's last error line (--quiet shows them)
        self._bar: tqdm | None = None
        self.log_error: OSError | None = None  # the first write the logs' disk refused
        os.makedirs(log_dir, exist_ok=True)

    # ------------------------------------------------------------------------- logs

    def log(self, name: str, line: str) -> None:
        """One line of a child's stdout or stderr."""
        line = line.rstrip("\n")
        with self._lock:
            try:  # (a full disk loses log lines, not the job: said once it ends)
                f = self._files.get(name)
                if f is None:
                    f = self._files[name] = open(os.path.join(self.log_dir, f"{name}.log"),
                                                 "a", buffering=1, encoding="utf-8",
                                                 errors="replace")
                f.write(line + "\n")
            except OSError as e:
                self.log_error = self.log_error or e
            if FATAL.search(line):
                self.errors[name] = line[-500:]
            if TRACEBACK.match(line):
                self._traceback.add(name)
            if RECORD.match(line):
                self._loud.discard(name)
                if LOUD.search(line):
                    self._loud.add(name)
            loud = name in self._traceback or name in self._loud or LOUD.search(line)
            if name in self._traceback and line and not line[0].isspace() and \
                    not TRACEBACK.match(line) and not line.startswith("During handling"):
                self._traceback.discard(name)  # its last line: "SomeError: ..."
            if self.verbose or (not self.quiet and loud):
                self._write(f"[{name}] {line}", sys.stderr)

    def note(self, text: str, err: bool = True) -> None:
        """A launcher message (a restart, a failure: stderr) or a result (stdout)."""
        with self._lock:
            self._write(text, sys.stderr if err else self.out)

    def _write(self, text: str, stream: TextIO) -> None:
        if self._bar is not None:
            with _unless_gone(stream):
                self._bar.write(text, file=stream)  # above the bar, which is redrawn
        else:
            say(text, stream)

    # ------------------------------------------------------------------------- progress

    def start(self, done: int = 0) -> None:
        with self._lock:
            if self.tty and self._bar is None:
                self._bar = tqdm(total=self.total, initial=done, unit="step", file=self.out,
                                 dynamic_ncols=True, smoothing=0.1,
                                 bar_format="{l_bar}{bar}| {n}/{total} [{elapsed}<{remaining}"
                                            "{postfix}]")

    def step(self, row: dict) -> None:
        """A step every worker reported: step, loss, accuracy, seconds, samples and, when the
        workers report them, compute / fetch_wait / push_wait (seconds, slowest worker)."""
        loss = row["loss"]
        self._loss = loss if self._loss is None else (SMOOTHING * self._loss
                                                      + (1 - SMOOTHING) * loss)
        rate = row["samples"] / row["seconds"] if row["seconds"] > 0 else 0.0
        with self._lock:
            if self._bar is not None:  # redrawn every step: the smoothed loss
                with _unless_gone(self.out):
                    self._bar.set_postfix_str(self._fields(row, rate, self._loss),
                                              refresh=False)
                    self._bar.update(row["step"] + 1 - self._bar.n)
                return
            n = row["step"] + 1  # a line now and then: the step's own loss, as in the summary
            if n % self.every == 0 or n == self.total or n == 1:
                say(f"step {n:>5}/{self.total}  {self._fields(row, rate, loss)}", self.out)

    def _fields(self, row: dict, rate: float, loss: float) -> str:
        parts = [f"loss {loss:.4f}", f"acc {row['accuracy']:.3f}", f"{rate:,.0f} samples/s"]
        if row.get("fetch_wait") is not None and row["seconds"] > 0:
            split = {k: row[k] / row["seconds"] for k in ("compute", "fetch_wait", "push_wait")}
            parts.append(f"compute {split['compute']:.0%} wait weights "
                         f"{split['fetch_wait']:.0%} acks {split['push_wait']:.0%}")
        return "  ".join(parts)

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                with _unless_gone(self.out):
                    self._bar.close()
                self._bar = None
            for f in self._files.values():
                try:
                    f.close()  # (flushes: the disk may refuse the rest now)
                except OSError as e:
                    self.log_error = self.log_error or e
            self._files.clear()


def say(text: str, stream: TextIO | None = None) -> None:
    """Print a line; a reader that went away (``| head``, a pager quit) stops the output,
    not the run: the launcher still stops its children cleanly and writes its summaries."""
    with _unless_gone(stream or sys.stdout):
        print(text, file=stream or sys.stdout, flush=True)


@contextlib.contextmanager
def _unless_gone(stream: TextIO):
    try:
        yield
    except BrokenPipeError:
        try:  # later writes, and the flush at exit, go nowhere instead of raising again
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, io.UnsupportedOperation):
            pass


def table(rows: list[tuple[str, str]], title: str) -> str:
    """The final summary: a two-column table."""
    width = max(len(k) for k, _ in rows)
    lines = [title, "-" * len(title)]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)
