import os
import secrets
from pathlib import Path

# L2L_TEST_SESSION marks every process this test run starts (xdist workers inherit the
# controller's): a region of a live run whose lock holder lacks it belongs to another run on
# this machine (a demo, a second suite), not to a leak of this one.
os.environ["L2L_TEST_SESSION"] = os.environ.get("L2L_TEST_SESSION") or secrets.token_hex(8)

# fp32 means fp32 on a GPU too, in this process and the ones it starts (tests/helpers.ENV):
# images that turn TF32 on by environment (NVIDIA's) would make every fp32 comparison a TF32 one.
os.environ["NVIDIA_TF32_OVERRIDE"] = "0"
os.environ.pop("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", None)

import pytest  # noqa: E402
import torch  # noqa: E402

from protocol.shm import SHM_DIR, list_regions

from .helpers import Cluster

torch.set_num_threads(1)
REGIONS = pytest.StashKey[set]()
SESSION = "L2L_TEST_SESSION"


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="session")
def failure_free(tmp_path_factory):
    """``failure_free(*options)``: the bytes --save writes for an l2l-launch job with these
    options that nothing interrupts, run once per session for the tests that interrupt that
    job and compare its weights (tests/test_recovery.py, tests/test_disk_full.py)."""
    import subprocess

    from .helpers import ENV
    from .test_launch import LAUNCH

    done: dict[tuple[str, ...], bytes] = {}

    def get(*options: str) -> bytes:
        if options not in done:
            d = tmp_path_factory.mktemp("failure-free")
            p = subprocess.run([*LAUNCH, *options, "--save", str(d / "m.st")], env=ENV, cwd=d,
                               capture_output=True, text=True, timeout=240)
            assert p.returncode == 0, p.stderr
            done[options] = (d / "m.st").read_bytes()
        return done[options]

    return get


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


# Under pytest-xdist (make test, and the GPU check's CUDA tests) one process cannot tell
# another's live regions from its own leaks: the controller checks the whole run.
XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ


def pytest_collection_modifyitems(config, items):
    """Exclusive tests last, in a row (a stable sort): each wait for the room to empty costs
    the other processes' time, once for a row that one process runs (below)."""
    items.sort(key=exclusive)


def exclusive(item) -> bool:
    return item.get_closest_marker("exclusive") is not None


HELD: list[int] = []  # this process's turnstile and room while exclusive tests follow in a row


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist a test marked ``exclusive`` runs while no other test does: it judges
    state this whole machine shares (a killed server's regions in /dev/shm, which the start of
    any eps-server sweeps). Two flock()s, a turnstile and a room, in the folder of this run's
    workers: a test passes the turnstile and shares the room; an exclusive one holds the
    turnstile (no test comes in) while it waits for the room to empty and while it runs.
    Around the whole protocol: fixtures of every scope are set up and torn down inside, and
    the wait is outside the test's timeout."""
    if not XDIST_WORKER:
        yield
        return
    import fcntl

    alone = exclusive(item)
    fds = HELD[:] or [os.open(Path(item.config.option.basetemp).parent / f"l2l-{part}.lock",
                              os.O_RDWR | os.O_CREAT, 0o600) for part in ("gate", "room")]
    HELD.clear()  # (xdist: basetemp is <the run's basetemp>/popen-gwN)
    keep = False
    try:
        fcntl.flock(fds[0], fcntl.LOCK_EX)  # (again, for a held one: a no-op)
        fcntl.flock(fds[1], fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(fds[0], fcntl.LOCK_UN)
        yield
        keep = alone and nextitem is not None and exclusive(nextitem)
    finally:
        if keep:
            HELD[:] = fds
        else:
            for fd in fds:
                os.close(fd)  # (the last close of a file drops its locks)


def _lock_holders() -> dict[tuple[int, int, int], int]:
    """{(device major, minor, inode): pid} of the flock()s held on this machine (/proc/locks:
    "1: FLOCK ADVISORY WRITE <pid> <major:minor:inode> ...", numbers of the device in hex)."""
    holders = {}
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and fields[1] == "FLOCK":
                    major, minor, inode = fields[5].split(":")
                    holders[int(major, 16), int(minor, 16), int(inode)] = int(fields[4])
    except (OSError, ValueError):
        pass
    return holders


def _ours(pid: int) -> bool:
    if pid == os.getpid():  # (its /proc environ is what it started with, without the mark)
        return True
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{SESSION}={os.environ[SESSION]}".encode() in f.read().split(b"\0")
    except OSError:  # gone, or not readable (another user's): not a process of this run
        return False


def leaked_regions(before: set[str]) -> set[str]:
    """Regions made since ``before`` less those of runs that live processes of other test runs
    or jobs hold (their run lock, l2l-<run>-lock, flock()ed by a process without this run's
    mark). A region of a dead run, or of a run a process of this one still holds, leaked."""
    new = set(list_regions("l2l-")) - before
    holders = _lock_holders()
    foreign = set()
    for run in {name.split("-")[1] for name in new if name.count("-") >= 2}:
        try:
            st = os.stat(os.path.join(SHM_DIR, f"l2l-{run}-lock"))
        except FileNotFoundError:
            continue
        pid = holders.get((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino))
        if pid is not None and not _ours(pid):
            foreign |= {name for name in new if name.split("-")[1] == run}
    return new - foreign


@pytest.fixture(scope="session", autouse=True)
def no_leaked_regions():
    """Every test run must leave /dev/shm as it found it."""
    before = set(list_regions("l2l-"))
    yield
    leaked = leaked_regions(before)
    assert XDIST_WORKER or not leaked, f"shared memory leaked by the tests: {sorted(leaked)}"


def pytest_sessionstart(session):
    session.config.stash[REGIONS] = set(list_regions("l2l-"))


def pytest_sessionfinish(session, exitstatus):
    if XDIST_WORKER or not getattr(session.config.option, "numprocesses", None):
        return  # checked by the fixture above
    leaked = leaked_regions(session.config.stash[REGIONS])
    if leaked:
        print(f"\nshared memory leaked by the tests: {sorted(leaked)}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
