"""Under pytest-xdist (`make test` runs the suite in a process per core) a test marked `exclusive`
runs while no other test does (tests/conftest.py: pytest_runtest_protocol)."""

from __future__ import annotations

import pytest

from .helpers import inner_pytest

TESTS = """
import os, time, pytest
D = {dir!r}

def running():
    return sorted(os.listdir(D))

def busy(name):
    open(os.path.join(D, name), "w").close()
    time.sleep(0.8)
    os.unlink(os.path.join(D, name))

@pytest.mark.parametrize("i", range(6))
def test_shares_the_room(i):
    assert "alone" not in running()
    busy(f"shared-{{i}}")

@pytest.mark.exclusive
@pytest.mark.parametrize("i", range(2))
def test_alone(i):
    open(os.path.join(D, "alone"), "w").close()
    for _ in range(10):
        assert running() == ["alone"]
        time.sleep(0.05)
    os.unlink(os.path.join(D, "alone"))
"""


@pytest.mark.exclusive  # (an outer test's regions would be this run's leaks)
def test_an_exclusive_test_runs_while_no_other_does(tmp_path):
    """Six tests of 0.8 s each keep both processes busy, and two exclusive ones follow (last,
    as conftest.py sorts them), one process reaching them while the other still runs shared
    ones: each finds no other test running, from its start to its end (without the turns,
    one finds another's file), and no test starts while one runs."""
    pytest.importorskip("xdist")
    room = tmp_path / "room"
    room.mkdir()
    (tmp_path / "test_turns.py").write_text(TESTS.format(dir=str(room)))
    # worksteal: each process starts with half the tests, in order, so one of them reaches
    # the exclusive tests (last, conftest.py) while the other still runs shared ones
    r = inner_pytest(tmp_path / "test_turns.py", "--dist", "worksteal", "-o",
                     "markers=exclusive: alone")
    assert r.returncode == 0 and "8 passed" in r.stdout, r.stdout + r.stderr
