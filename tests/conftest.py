import os

# fp32 means fp32 on a GPU too, in this process and the ones it starts (tests/helpers.ENV):
# images that turn TF32 on by environment (NVIDIA's) would make every fp32 comparison a TF32 one.
os.environ["NVIDIA_TF32_OVERRIDE"] = "0"
os.environ.pop("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", None)

import pytest  # noqa: E402
import torch  # noqa: E402

from protocol.shm import list_regions

from .helpers import Cluster

torch.set_num_threads(1)
REGIONS = pytest.StashKey[set]()


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


# Under pytest-xdist (the GPU check runs the CUDA tests in several processes) one process
# cannot tell another's live regions from its own leaks: the controller checks the whole run.
XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ


@pytest.fixture(scope="session", autouse=True)
def no_leaked_regions():
    """Every test run must leave /dev/shm as it found it."""
    before = set(list_regions("l2l-"))
    yield
    leaked = set(list_regions("l2l-")) - before
    assert XDIST_WORKER or not leaked, f"shared memory leaked by the tests: {sorted(leaked)}"


def pytest_sessionstart(session):
    session.config.stash[REGIONS] = set(list_regions("l2l-"))


def pytest_sessionfinish(session, exitstatus):
    if XDIST_WORKER or not getattr(session.config.option, "numprocesses", None):
        return  # checked by the fixture above
    leaked = set(list_regions("l2l-")) - session.config.stash[REGIONS]
    if leaked:
        print(f"\nshared memory leaked by the tests: {sorted(leaked)}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
