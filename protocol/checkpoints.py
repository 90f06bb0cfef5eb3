"""Where EPS checkpoints live on disk, and how a reader knows one is whole (shared: the EPS
writes them, ``l2l-export`` reads them).

A checkpoint *root* (``--server-save DIR``) holds one directory per checkpoint and a pointer to
the newest complete one:

    DIR/step-00000042/   manifest.json, state.json, master.safetensors, optimizer.safetensors,
                         checksums.json (sha256 and size of every other file)
    DIR/latest           "step-00000042": replaced atomically once that directory is complete

A checkpoint directory is written under a temporary name and renamed when every file is
written and fsynced; ``latest`` moves only then; older ones beyond ``--keep-checkpoints`` are
removed after that. Killing the writer at any moment leaves the previous checkpoint in place.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor

LATEST = "latest"
CHECKSUMS = "checksums.json"
PREFIX = "step-"


def step_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def is_root(path: str) -> bool:
    return os.path.isfile(os.path.join(path, LATEST)) or any(
        n.startswith(PREFIX) and os.path.isdir(os.path.join(path, n))
        for n in os.listdir(path))


def resolve(path: str) -> str:
    """The checkpoint directory ``path`` names: itself (a checkpoint directory), the one a
    root's ``latest`` points to, or, in a root without ``latest`` (its writer was stopped
    between renaming its first checkpoint into place and pointing ``latest`` at it), the
    newest: a ``step-*`` directory is complete once it has that name."""
    if os.path.isfile(os.path.join(path, "state.json")):
        return path
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        with open(latest) as f:
            name = f.read().strip()
        if not name.startswith(PREFIX) or "/" in name:
            raise ValueError(f"{latest}: not a checkpoint name ({name!r})")
        if not os.path.isdir(os.path.join(path, name)):
            there = sorted(n for n in os.listdir(path) if _order(n))
            raise FileNotFoundError(f"{latest} names {name}, which is not there (removed?); "
                                    f"checkpoints there: {', '.join(there) or 'none'} (--load "
                                    "one of them by its directory)")
        return os.path.join(path, name)
    done = [n for n in os.listdir(path) if _order(n) and os.path.isdir(os.path.join(path, n))]
    if done:
        return os.path.join(path, max(done, key=_order))
    raise FileNotFoundError(f"no checkpoint at {path} (no state.json, no {LATEST})")


def held(path: str) -> list[tuple[int, str]]:
    """(step, directory) of every complete checkpoint ``path`` names, newest first: a
    checkpoint directory itself, or each of a root's up to the one ``resolve`` picks (a root
    may also hold newer ones of an abandoned history; a step saved twice: its last save)."""
    if os.path.isfile(os.path.join(path, "state.json")):
        with open(os.path.join(path, "state.json")) as f:
            return [(int(json.load(f)["step"]), path)]
    upto = _order(os.path.basename(resolve(path))) or (1 << 62, 0)
    newest: dict[int, tuple[tuple[int, int], str]] = {}
    for name in os.listdir(path):
        order = _order(name)
        if order and order <= upto and os.path.isdir(os.path.join(path, name)) and \
                order > newest.get(order[0], ((-1, -1), ""))[0]:
            newest[order[0]] = (order, os.path.join(path, name))
    return sorted(((step, d) for step, (_, d) in newest.items()), reverse=True)


def _order(name: str) -> tuple[int, int] | None:
    """(step, N) of ``step-<step>[-N]`` (a later save of the same step gets N), else None."""
    step, _, n = name[len(PREFIX):].partition("-")
    if name.startswith(PREFIX) and step.isdigit() and (n.isdigit() or not n):
        return int(step), int(n or 0)
    return None


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify(directory: str, checked=lambda name: None) -> None:
    """Raise ValueError naming the first file of ``directory`` that is missing, truncated or
    changed since it was written (checksums.json), or if there are no checksums at all;
    ``checked(name)`` after each file."""
    listed = os.path.join(directory, CHECKSUMS)
    try:
        with open(listed) as f:
            sums = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{listed}: missing; the checkpoint is incomplete") from None
    except ValueError as e:
        raise ValueError(f"{listed}: damaged ({e})") from None
    for name, want in sums.items():
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise ValueError(f"{path}: missing")
        size = os.path.getsize(path)
        if size != want["size"]:
            raise ValueError(f"{path}: {size} bytes, {want['size']} were written (truncated?)")
    # the files hashed at once (a thread hashes ~1 GB/s), judged in the listing's order
    pool = ThreadPoolExecutor(max(1, min(len(sums), 8)), thread_name_prefix="verify")
    try:
        got = {name: pool.submit(sha256_file, os.path.join(directory, name)) for name in sums}
        for name, want in sums.items():
            if got[name].result() != want["sha256"]:
                raise ValueError(f"{os.path.join(directory, name)}: checksum mismatch (damaged)")
            checked(name)
    finally:  # (a damaged file is said at once: the others' hashing is not waited for)
        pool.shutdown(wait=False, cancel_futures=True)


def latest(root: str) -> tuple[str, int] | None:
    """(the checkpoint directory ``root`` resolves to, its step), or None if there is none
    (yet), or none that can be read."""
    try:
        path = resolve(root)
        with open(os.path.join(path, "state.json")) as f:
            return path, int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def stamp(root: str):
    """What tells one checkpoint from another at ``root``'s latest: its path and when it was
    written (a new one may reuse an old one's name); None if there is none."""
    found = latest(root) if root else None
    if found is None:
        return None
    try:
        return found[0], os.stat(os.path.join(found[0], "state.json")).st_mtime_ns
    except OSError:
        return None
