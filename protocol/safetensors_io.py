"""Streaming, atomic safetensors writer (read files back with the ``safetensors`` library).

``safetensors.torch.save_file`` serialises every tensor to bytes in memory before writing and
refuses tensors that share storage; our tensors are views of one shared-memory region and may
be larger than the free memory, so this writes the (simple, documented) format directly:
8-byte little-endian header length, JSON header, then each tensor's raw bytes in order.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence

import torch

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8"}


def write_safetensors(path: str, tensors: Sequence[tuple[str, torch.Tensor]],
                      metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (name, CPU tensor) to ``path`` atomically (tmp file + rename)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, t in tensors:
        if name in header:
            raise ValueError(f"duplicate tensor name {name!r}")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header to 8 bytes
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for _, t in tensors:
                t = t.detach().cpu().contiguous()
                if t.numel():
                    f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
