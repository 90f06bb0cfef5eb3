"""The EPS's math threads: one pool, one thread per core, that runs the pieces of every
layer's passes (kernels.py), so a layer updated alone, as the last layers of a backward are,
has every core, and layers arriving together share them.

An engine (engines.py) hands the pool a pass as a list of pieces and waits for all of them
(``map``); pieces of concurrent passes run in the order they came. The kernels release the
GIL, so the threads run in parallel. Each pool thread runs torch with one thread of its own:
a piece is one core's share already.

``inline``: every piece on the calling thread, in order (tests that must be deterministic
in time as well as in bits; the bits never depend on the cut).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

# Elements per piece: 2^18 (1 MiB of fp32 per array) keeps a piece's work (~0.5-1 ms) far
# above the cost of handing it to a thread, and a BERT-Large layer in ~50 pieces, so 16 threads
# finish it within a few percent of each other. A multiple of kernels.BLOCK.
PIECE = 1 << 18


class _Batch:
    """One pass's pieces: counts them in, keeps the results and the first error."""

    def __init__(self, n: int):
        self.results: list[Any] = [None] * n
        self.left = n
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._lock = threading.Lock()

    def finish(self, index: int, result: Any, error: BaseException | None) -> None:
        with self._lock:
            self.results[index] = result
            if error is not None and self.error is None:
                self.error = error
            self.left -= 1
            last = self.left == 0
        if last:
            self.done.set()


class MathPool:
    def __init__(self, threads: int, *, inline: bool = False):
        self.threads = 1 if inline else max(1, threads)
        self.inline = inline
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = [] if inline else [
            threading.Thread(target=self._run, name=f"eps-math-{k}", daemon=True)
            for k in range(self.threads)]
        for t in self._workers:
            t.start()

    def map(self, fn: Callable[..., Any], pieces: Sequence[tuple]) -> list[Any]:
        """``[fn(*piece) for piece in pieces]``, the pieces on the pool's threads; raises the
        first error once every piece has finished (none is left running on shared state)."""
        if self.inline or len(pieces) <= 1 or not self._workers:
            return [fn(*piece) for piece in pieces]
        batch = _Batch(len(pieces))
        for index, piece in enumerate(pieces):
            self._queue.put((batch, index, fn, piece))
        batch.done.wait()
        if batch.error is not None:
            raise batch.error
        return batch.results

    def close(self) -> None:
        for _ in self._workers:
            self._queue.put(None)
        for t in self._workers:
            t.join()
        self._workers = []

    def _run(self) -> None:
        torch.set_num_threads(1)
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch, index, fn, piece = item
            try:
                result, error = fn(*piece), None
            except BaseException as e:  # reported to the pass's caller
                result, error = None, e
            batch.finish(index, result, error)


def cut(lo: int, hi: int, piece: int = PIECE) -> list[tuple[int, int]]:
    """[lo, hi) in ranges of at most ``piece`` elements, every inner bound a multiple of
    ``piece`` (so of kernels.BLOCK) counted from 0."""
    out = []
    start = lo
    while start < hi:
        end = min(hi, (start // piece + 1) * piece)
        out.append((start, end))
        start = end
    return out
