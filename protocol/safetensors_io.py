"""Streaming, atomic safetensors writer, and a zero-copy reader (``SafetensorsFile``).

``safetensors.torch.save_file`` serialises every tensor to bytes in memory before writing and
refuses tensors that share storage; our tensors are views of one shared-memory region and may
be larger than the free memory, so this writes the (simple, documented) format directly:
8-byte little-endian header length, JSON header, then each tensor's raw bytes in order.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections import deque
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

CHUNK = 64 << 20  # bytes written at once (with ``digest``: hashed while the next are written)


def written_dtype(t: torch.Tensor, dtype: torch.dtype | None, kept: bool = False) -> torch.dtype:
    """The dtype ``t`` is written in: a floating-point tensor's is ``dtype`` (None: its own),
    or fp32 if ``kept``; another tensor's its own."""
    if dtype is None or not t.is_floating_point():
        return t.dtype
    return torch.float32 if kept else dtype


def write_safetensors(path: str, tensors: Sequence[tuple[str, torch.Tensor]],
                      metadata: dict[str, str] | None = None, digest: bool = False,
                      dtype: torch.dtype | None = None,
                      keep: Collection[str] = ()) -> str | None:
    """Write ``tensors`` (name, CPU tensor) to ``path`` atomically (tmp file + rename).
    ``digest``: return the file's sha256, computed from the bytes as they are written, on a
    thread of its own (hashing and the writes release the GIL: they overlap, and the file is
    not read back); the tensors must not change until it returns. ``dtype``: floating-point
    tensors are written in it (rounded to nearest), one tensor converted at a time, but for
    the names in ``keep`` (written in fp32)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, t in tensors:
        if name in header:
            raise ValueError(f"duplicate tensor name {name!r}")
        out = written_dtype(t, dtype, name in keep)
        nbytes = t.numel() * out.itemsize
        header[name] = {"dtype": _ST_DTYPES[out], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header to 8 bytes
    tmp = f"{path}.tmp-{os.getpid()}"
    sha = hashlib.sha256() if digest else None
    hasher = ThreadPoolExecutor(1, thread_name_prefix="sha256") if digest else None
    hashing: deque = deque()  # the chunks being hashed, in order (at most two behind)

    def put(chunk) -> None:
        f.write(chunk)
        if sha is not None:
            hashing.append(hasher.submit(sha.update, chunk))
            if len(hashing) > 2:
                hashing.popleft().result()

    try:
        with open(tmp, "wb") as f:
            put(struct.pack("<Q", len(blob)) + blob)
            for name, t in tensors:
                t = t.detach().cpu().to(written_dtype(t, dtype, name in keep)).contiguous()
                if t.numel():
                    data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                    for i in range(0, len(data), CHUNK):
                        put(data[i:i + CHUNK])
            while hashing:
                hashing.popleft().result()
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    finally:
        if hasher is not None:
            hasher.shutdown(wait=True, cancel_futures=True)
    return sha.hexdigest() if sha is not None else None


_FROM_ST = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
            "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8,
            "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
if hasattr(torch, "float8_e8m0fnu"):  # (block scales of FP8 checkpoints)
    _FROM_ST["F8_E8M0"] = torch.float8_e8m0fnu
_ST_DTYPES = {dtype: name for name, dtype in _FROM_ST.items()}


class SafetensorsFile:
    """A safetensors file mapped copy-on-write: ``get(name)`` is a view of the file's bytes, no
    copy (the page cache holds them, not this process's heap), so reading a large checkpoint
    tensor by tensor allocates nothing. ``safe_open`` copies every tensor it returns."""

    def __init__(self, path: str):
        import mmap

        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            if size < 8:
                raise ValueError(f"{path}: not a safetensors file")
            n = struct.unpack("<Q", f.read(8))[0]
            if not 2 <= n <= size - 8:
                raise ValueError(f"{path}: not a safetensors file (header of {n} bytes)")
            header = json.loads(f.read(n))
            # Copy-on-write: reads share the page cache; a write to a view stays private.
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.metadata = header.pop("__metadata__", {})
        self._base, self._header, self._size = 8 + n, header, size

    def keys(self) -> list[str]:
        return list(self._header)

    def __contains__(self, name: str) -> bool:
        return name in self._header

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header[name]["shape"])

    def get(self, name: str) -> torch.Tensor:
        info = self._header[name]
        dtype = _FROM_ST.get(info["dtype"])
        start, end = (self._base + o for o in info["data_offsets"])
        shape = tuple(info["shape"])
        count = end - start
        if dtype is None or not self._base <= start <= end <= self._size or \
                count != dtype.itemsize * _numel(shape):
            raise ValueError(f"{self.path}: tensor {name!r} has a bad header entry")
        if not count:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(memoryview(self._mm)[start:end], dtype=dtype).view(shape)


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
