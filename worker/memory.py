"""Peak memory of a worker: CUDA allocator peak, or on CPU the peak *private* resident memory
(RSS minus shared pages, i.e. not counting the EPS's shared memory mapped into the worker)."""

from __future__ import annotations

import os
import threading

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE")


def private_rss() -> int:
    """Resident bytes that are not shared file/shm pages (Linux /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * _PAGE


class PeakMemory:
    """Samples private RSS every ``interval`` seconds (and whenever ``sample`` is called)."""

    def __init__(self, device: torch.device, interval: float = 0.002):
        self.device = device
        self.peak = 0
        self._stop = threading.Event()
        self._thread = None
        if device.type == "cpu":
            self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True,
                                            name="peak-memory")
            self._thread.start()
        else:
            torch.cuda.reset_peak_memory_stats(device)

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.sample()

    def sample(self) -> None:
        if self.device.type == "cpu":
            self.peak = max(self.peak, private_rss())

    def reset(self) -> None:
        self.peak = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def value(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        self.sample()
        return self.peak

    def current(self) -> int:
        """Bytes in use now (CUDA allocator, or private RSS on CPU)."""
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return private_rss()

    def close(self) -> None:
        self._stop.set()
