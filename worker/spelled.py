"""Option values spelled as text, read: sizes ("5GB"), block ranges ("0-3,20") and
pattern=value lists ("q_proj=16,layers\\.0\\..*=4")."""

from __future__ import annotations

import math
import re

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def size_bytes(text: str) -> int:
    """A size as save_pretrained's max_shard_size reads it ("5GB": 5 * 10**9, "2GiB": 2 * 2**30,
    or bytes), in bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m and _UNITS.get(m.group(2).upper())
    if not unit or float(m.group(1)) * unit < 1:
        raise ValueError(f"--save-max-shard-size {text!r}: give a size such as 5GB, 500MB or "
                         "2GiB")
    return int(float(m.group(1)) * unit)


def lora_layers(spec: str) -> tuple[int, ...]:
    """--lora-layers: the block indices it names ("0-3,20": 0, 1, 2, 3, 20), sorted."""
    out = set()
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
        if not m or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            raise ValueError(f"--lora-layers {spec!r}: give block indices and ranges, e.g. "
                             "0-3,20")
        out.update(range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1))
    return tuple(sorted(out))


def patterns(spec: str, what: str, integer: bool) -> dict[str, float]:
    """--lora-rank-pattern / --lora-alpha-pattern: {regular expression: value}, in the order
    given ("PATTERN=VALUE,..."; a value >= 1 for a rank, > 0 for an alpha)."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        key, eq, value = (t.strip() for t in part.rpartition("="))
        try:  # (as PEFT matches it: the whole name, or its end after a '.')
            re.compile(rf"(.*\.)?({key})$")
            number = int(value) if integer else float(value)
        except (re.error, ValueError, OverflowError):
            number = None
        if not eq or not key or number is None or not 0 < number < math.inf or (
                integer and number < 1):
            raise ValueError(f"{what} {spec!r}: give PATTERN=VALUE pairs (a regular expression "
                             f"of a module's name, a {'rank' if integer else 'positive alpha'}),"
                             " e.g. q_proj=16")
        out[key] = number
    return out
