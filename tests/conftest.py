import pytest
import torch

from protocol.shm import list_regions

from .helpers import Cluster

torch.set_num_threads(1)


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def make():
    """Harness factory (an in-process EPS core each); every one is closed after the test."""
    from .test_core import Harness

    made = []

    def factory(*args, **kw):
        made.append(Harness(*args, **kw))
        return made[-1]

    yield factory
    for h in made:
        h.close()


@pytest.fixture(scope="session", autouse=True)
def no_leaked_regions():
    """Every test run must leave /dev/shm as it found it."""
    before = set(list_regions("l2l-"))
    yield
    leaked = set(list_regions("l2l-")) - before
    assert not leaked, f"shared memory leaked by the tests: {sorted(leaked)}"
