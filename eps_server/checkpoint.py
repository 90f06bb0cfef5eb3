"""Checkpoints of the EPS: manifest, fp32 master, optimizer state, step (protocol/checkpoints.py
says how they lie on disk: one directory per checkpoint under a root, a ``latest`` pointer, a
checksum for every file).

    manifest.json          the model manifest (the EPS can start from it alone)
    state.json             format, step, versions, manifest hash, when written, optimizer and
                           loss-scaler state, the data position
    master.safetensors     "<layer>/<tensor>" -> fp32 tensor with its real shape
    optimizer.safetensors  "<layer>/<state key>" -> optimizer state
    checksums.json         sha256 and size of each of the above, checked on load

A checkpoint is written under a temporary name (files fsynced), renamed into place, and only
then made ``latest``; the oldest beyond ``keep`` are removed after that. A root that holds
anything but checkpoints, or checkpoints of another model, is refused, never written into. One
process at a time writes a root (an flock on its ``.lock``): a serving EPS holds its
--server-save from the start.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from protocol import checkpoints as layout_on_disk
from protocol.checkpoint_tensors import CheckpointTensors
from protocol.safetensors_io import write_safetensors
from protocol.tensors import Manifest, manifest_from_json, manifest_to_json, plan_layout

FORMAT = 2  # 2: a root of checkpoint directories, checksums
log = logging.getLogger("eps_server")


LOCK = ".lock"  # in a root: flock-ed by the process writing checkpoints there
_held: dict[str, int | None] = {}  # realpath of each root a server holds -> its lock's fd


def _ours(name: str) -> bool:
    """Hidden entries this module makes in a root: the lock, unfinished writes."""
    return name == LOCK or (name.startswith(".") and ".tmp-" in name)


def check_target(root: str) -> None:
    """Raise ValueError unless ``root`` may receive checkpoints: it does not exist (its parent
    does), is an empty directory (but for our lock and unfinished writes), or is a checkpoint
    root. Anything else is left alone."""
    root = os.path.abspath(root)
    if not os.path.exists(root):
        if not os.path.isdir(os.path.dirname(root)):
            raise ValueError(f"cannot write a checkpoint to {root}: no such parent directory")
        return
    if not os.path.isdir(root):
        raise ValueError(f"{root} exists and is not a directory; not overwriting it")
    try:
        entries = os.listdir(root)
    except OSError as e:  # (unreadable: /proc/1/map_files, a folder of another user)
        raise ValueError(f"cannot read {root}: {e.strerror}") from None
    if [n for n in entries if not _ours(n)] and not layout_on_disk.is_root(root):
        raise ValueError(f"{root} is a non-empty directory that is not a checkpoint root; "
                         "not writing into it")


def _remove(path: str) -> None:
    """A leftover of ours: a folder (an unfinished checkpoint) or a file (a pointer, a marker)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.remove(path)


def check_model(root: str, manifest_hash: str) -> None:
    """Raise ValueError if ``root`` holds a checkpoint of another model than ``manifest_hash``:
    writing there would prune it (``keep``) and point ``latest`` at another model."""
    root = os.path.abspath(root)
    try:
        names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    except OSError:
        return  # (check_writable says why it cannot be read)
    for name in names:
        state = os.path.join(root, name, "state.json")
        if not name.startswith(layout_on_disk.PREFIX) or not os.path.isfile(state):
            continue
        try:
            with open(state) as f:
                theirs = json.load(f).get("manifest_hash")
        except (OSError, ValueError, AttributeError):
            continue  # not readable: not known to be another model's (loading it says why)
        if theirs != manifest_hash:
            raise ValueError(
                f"{root} holds checkpoints of another model ({name}: manifest "
                f"{str(theirs)[:19]}, this job's is {manifest_hash[:19]}); writing there would "
                "remove them: choose another folder")


def check_writable(root: str, manifest_hash: str | None = None) -> None:
    """``check_target``, and this process can write there: ``root`` is made (if need be) and
    its lock taken and let go now, so that a path the EPS cannot write (read-only, under
    /proc, a busy root) is refused when asked for, with the reason, rather than failing at
    the step boundary; with ``manifest_hash``, also ``check_model``. ValueError if not."""
    try:
        with _holding(os.path.abspath(root)):
            pass
    except OSError as e:
        raise ValueError(str(e)) from None
    if manifest_hash is not None:
        check_model(root, manifest_hash)


def _lock(root: str) -> int | None:
    """Make ``root`` (an unwritable one fails here) and take its lock: an fd, or None where
    the file system has no locks (a warning). Two processes writing one root pruned each
    other's checkpoints, even those being written."""
    check_target(root)
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        fd = os.open(os.path.join(root, LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise OSError(e.errno, f"cannot write checkpoints to {root}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise ValueError(f"checkpoint folder {root} is in use by another process (two "
                             "writing one folder prune each other's checkpoints)") from None
        log.warning("checkpoint folder %s: its file system refuses locks (%s); nothing keeps "
                    "a second writer out", root, e.strerror)  # Lustre without -o flock, ...
        return None
    return fd


def hold_root(root: str) -> bool:
    """Hold ``root`` (--server-save) until ``release_root``: made and locked now, so that an
    unwritable or busy one is refused before training, not at its first checkpoint. False if
    this process holds it already (then it is not this caller's to release)."""
    root = os.path.realpath(root)
    if root in _held:
        return False
    _held[root] = _lock(root)
    for n in os.listdir(root):  # what a killed writer left (on a full disk, it stays in the way)
        if _ours(n) and n != LOCK:
            _remove(os.path.join(root, n))
    return True


def release_root(root: str) -> None:
    fd = _held.pop(os.path.realpath(root), None)
    if fd is not None:
        os.close(fd)


@contextlib.contextmanager
def _holding(root: str):
    """``root`` locked for one checkpoint (l2l-ctl save to a folder), unless held already."""
    if os.path.realpath(root) in _held:
        yield
        return
    fd = _lock(root)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _write_json(path: str, obj) -> dict:
    data = json.dumps(obj).encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": layout_on_disk.sha256_file(path), "size": len(data)}


def save(root: str, store, optimizers, extra: dict, keep: int = 1, boxes=None) -> str:
    """Write the store's master and the optimizers' state at a step boundary (on an engine,
    the others parked) as a new checkpoint under ``root``; returns its directory. In shard
    mode every box calls this at the same boundary (``boxes``: its CrossBox; shard_save.py)."""
    root = os.path.abspath(root)
    check_model(root, store.manifest_hash)  # (every path: l2l-ctl save, --server-save)
    if store.sharding is not None:
        from .shard_save import save_shards  # (box 0 holds the root; the others write in it)

        with _holding(root) if store.sharding.rank == 0 else contextlib.nullcontext():
            return save_shards(root, store, optimizers, extra, keep, boxes)
    with _holding(root):
        return _save(root, store, optimizers, extra, keep)


def _save(root: str, store, optimizers, extra: dict, keep: int) -> str:
    name = _new_name(root, layout_on_disk.step_name(store.step))
    tmp = os.path.join(root, f".{name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp, mode=0o700)
    try:
        master, opt_state = [], []
        for plan in store.layout.layers:
            master += [(f"{plan.name}/{slot.name}", view) for frozen in (False, True)
                       for slot, view in master_views(store, plan, frozen)]
            for key, t in optimizers[plan.index].state_tensors().items():
                opt_state.append((f"{plan.name}/{key}", t))
        sums = write_tensor_files(tmp, (("master.safetensors", master),
                                        ("optimizer.safetensors", opt_state)))
        write_metadata(tmp, store, extra, sums)
        commit(root, tmp, name, keep)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return os.path.join(root, name)


def master_views(store, plan, frozen: bool) -> list:
    """(slot, view) of the layer's trained tensors in the master (``frozen``: its frozen ones,
    in the served copy, whose values they are: written in its dtype, read back as fp32)."""
    flat = store.compute(plan.index) if frozen else store.master(plan.index)
    return [(s, flat[s.offset:s.offset + s.numel].view(s.shape)) for s in plan.tensors
            if (s.group == "frozen") == frozen]


def write_tensor_files(tmp: str, files) -> dict:
    """Each (file, [(name, tensor)]) written under ``tmp``, the files at once (each hashed as it
    is written: the host's hashing, ~1 GB/s a thread, would otherwise set the pace); their
    checksums."""
    files = list(files)

    def write(file: str, tensors) -> dict:
        path = os.path.join(tmp, file)
        sha256 = write_safetensors(path, tensors, digest=True)
        return {"sha256": sha256, "size": os.path.getsize(path)}

    with ThreadPoolExecutor(len(files) or 1, thread_name_prefix="checkpoint") as pool:
        done = [pool.submit(write, file, tensors) for file, tensors in files]
        return {file: d.result() for (file, _), d in zip(files, done)}


def write_metadata(tmp: str, store, extra: dict, sums: dict) -> None:
    """manifest.json, state.json and checksums.json (of those and ``sums``' files)."""
    sums = {**sums,
            "manifest.json": _write_json(os.path.join(tmp, "manifest.json"),
                                         manifest_to_json(store.manifest)),
            "state.json": _write_json(os.path.join(tmp, "state.json"), {
                "format": FORMAT, "step": store.step, "versions": store.versions,
                "manifest_hash": store.manifest_hash, "written_ns": time.time_ns(), **extra})}
    _write_json(os.path.join(tmp, layout_on_disk.CHECKSUMS), sums)


def commit(root: str, tmp: str, name: str, keep: int) -> None:
    """The complete checkpoint at ``tmp`` renamed to ``name`` and made the latest; the oldest
    beyond ``keep`` removed. Raises with nothing of it left (the previous latest stands)."""
    _fsync_dir(tmp)
    final = os.path.join(root, name)
    os.replace(tmp, final)
    _fsync_dir(root)
    pointer = os.path.join(root, f".{layout_on_disk.LATEST}.tmp-{os.getpid()}")
    try:
        with open(pointer, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
    except BaseException:  # the previous checkpoint stays the latest: this one goes
        for leftover in (pointer, final):
            shutil.rmtree(leftover, ignore_errors=True)
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.remove(leftover)
        raise
    os.replace(pointer, os.path.join(root, layout_on_disk.LATEST))  # now it is the latest
    _fsync_dir(root)
    _prune(root, name, keep)


def _new_name(root: str, base: str) -> str:
    """``base``, or ``base-N`` after every earlier checkpoint of the same step in ``root``
    (names are never reused)."""
    seen = [-1]
    for n in os.listdir(root):
        if n == base:
            seen.append(0)
        elif n.startswith(base + "-") and n[len(base) + 1:].isdigit():
            seen.append(int(n[len(base) + 1:]))
    k = max(seen) + 1
    return f"{base}-{k}" if k else base


def _prune(root: str, current: str, keep: int) -> None:
    """Keep the ``keep`` most recently written checkpoints (``current`` among them; a copied
    folder's by what its state.json says); remove the others and what an interrupted writer
    left."""
    entries = os.listdir(root)
    for n in entries:
        if _ours(n) and n != LOCK:
            _remove(os.path.join(root, n))
    done = [n for n in entries if n.startswith(layout_on_disk.PREFIX)
            and os.path.isdir(os.path.join(root, n))]
    done.sort(key=lambda n: _written(os.path.join(root, n)), reverse=True)
    others = [n for n in done if n != current]
    kept = {current, *others[:keep - 1]}
    for n in done:
        if n not in kept:
            shutil.rmtree(os.path.join(root, n), ignore_errors=True)


def _written(path: str) -> float:
    """When the checkpoint at ``path`` was written: its state.json says (a copy of the folder,
    whose times are the copy's, keeps it), else (an older checkpoint) the folder's time."""
    try:
        with open(os.path.join(path, "state.json")) as f:
            return json.load(f)["written_ns"] / 1e9
    except (OSError, ValueError, KeyError, TypeError):
        return os.path.getmtime(path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Loaded:
    path: str
    manifest: Manifest
    state: dict


def read_meta(path: str, checked=lambda name: None) -> Loaded:
    """The checkpoint at ``path`` (a root's latest, or a checkpoint directory), its files
    checked against their checksums (``checked(name)`` after each): a damaged one is refused
    naming the file."""
    path = layout_on_disk.resolve(path)
    layout_on_disk.verify(path, checked)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = manifest_from_json(json.load(f))
    with open(os.path.join(path, "state.json")) as f:
        state = json.load(f)
    if state.get("format") != FORMAT:
        raise ValueError(f"{path}: unsupported checkpoint format {state.get('format')}")
    if state["manifest_hash"] != manifest.hash():
        raise ValueError(f"{path}: manifest does not match its recorded hash")
    return Loaded(path, manifest, state)


def load_into(loaded: Loaded, store, optimizers, progress=lambda done, total: None) -> None:
    """Fill the store (master, served copy) and the optimizers' state from a checkpoint,
    written by one EPS or by the boxes of a shard job, whatever the number of boxes now: each
    layer is read whole and the store keeps its part (protocol/checkpoint_tensors.py).
    ``progress(layers done, layers)`` after each layer."""
    tensors = CheckpointTensors(loaded.path, loaded.state)
    for plan in plan_layout(loaded.manifest).layers:
        store.write_initial(plan.index, tensors.master(plan))
        lo, hi = store.spans[plan.index]
        state = {k: t if t.dim() == 0 else t[lo:hi]
                 for k, t in tensors.optimizer(plan).items()}
        optimizers[plan.index].load_state_tensors(state)
        progress(plan.index + 1, len(optimizers))
