"""The EPS's torch threads, shared by its math engines (engines.py) busy at a time.

A job takes ``threads // busy`` (at least 1) as it starts, and the long loops within it (the
optimizers' chunk loops) call ``rebalance()`` to take a new share as other engines start or
finish. While a backward pass streams gradients in, many engines update at once with a few
threads each; a layer updated alone, as the step's last ones often are (the next forward
waits for them), gets them all, also when it started while the others were busy. (Each engine
with every thread oversubscribed the cores: n engines x n OpenMP threads.)

Torch's thread count is per thread (OpenMP's), so a share set here changes no other engine's;
but torch sets a thread's count from the last one set anywhere at the thread's first parallel
op, so that first op is made to happen before the share is set.
"""

from __future__ import annotations

import contextlib
import threading

import torch

# Engines beyond a few add no parallelism the shared threads do not give, only OpenMP pools:
# each engine thread keeps one as large as the most threads it was ever given.
MAX_ENGINES = 8

_local = threading.local()  # .budget: the budget whose share this thread holds, if any


class ThreadBudget:
    def __init__(self, threads: int):
        self.threads = max(1, threads)
        self._busy = 0
        self._lock = threading.Lock()

    def _fair(self) -> int:
        with self._lock:
            return max(1, self.threads // max(1, self._busy))

    @contextlib.contextmanager
    def share(self):
        """Hold a share while a job runs; yields the thread count taken."""
        with self._lock:
            self._busy += 1
        torch.get_num_threads()  # the thread's first parallel op: before ours (see above)
        _local.budget, _local.held = self, self._fair()
        torch.set_num_threads(_local.held)
        try:
            yield _local.held
        finally:
            _local.budget = None
            with self._lock:
                self._busy -= 1

    def rebalance(self) -> int:
        """Take the share that is fair now (the calling thread holds one); returns it."""
        n = self._fair()
        if n != _local.held:
            torch.set_num_threads(n)
            _local.held = n
        return n


def rebalance() -> None:
    """From a long loop in an engine's job: take the fair share of threads now. Elsewhere (an
    inline engine, a test, another process's optimizer) nothing."""
    budget = getattr(_local, "budget", None)
    if budget is not None:
        budget.rebalance()
