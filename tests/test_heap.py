"""The CPU worker's heap trimming: the pages of freed chunks between live ones go back."""

import os
import subprocess
import sys

import pytest

from worker.heap import HeapTrimmer, _glibc, heap_trimmer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_trims_every_nth_visit_and_only_on_cpu_with_the_eps_stash():
    t = HeapTrimmer(3)
    for _ in range(7):
        t.tick()
    assert t.trims == (2 if _glibc() is not None else 0)
    never = HeapTrimmer(0)
    for _ in range(5):
        never.tick()
    assert never.trims == 0
    assert heap_trimmer("cpu", "eps").every > 0 or _glibc() is None
    assert heap_trimmer("cpu", "device").every == 0
    assert heap_trimmer("cuda", "eps").every == 0


HOLES = """
import torch
from worker.heap import HeapTrimmer
from worker.memory import private_rss
big, pins = [], []
for _ in range(1200):
    big.append(torch.ones(25_600))  # 100 KiB, touched
    pins.append(torch.ones(16))
before = private_rss()
big.clear()
holed = private_rss()
HeapTrimmer(1).tick()
print(before >> 20, holed >> 20, private_rss() >> 20)
"""


@pytest.mark.skipif(_glibc() is None, reason="needs glibc's malloc_trim")
def test_a_trim_returns_the_holes_left_between_live_chunks():
    """In a fresh process (a heap with no history): 100 KiB chunks come from the heap (below
    glibc's mmap threshold), and a small live tensor after each keeps the top of the heap
    from shrinking when the big ones are freed; a trim gives their pages back."""
    out = subprocess.run([sys.executable, "-c", HOLES], capture_output=True, text=True,
                         timeout=120, check=True, cwd=ROOT)
    before, holed, trimmed = map(int, out.stdout.split())
    assert holed > before - 60  # MiB: freed, but still resident
    assert trimmed < holed - 60
