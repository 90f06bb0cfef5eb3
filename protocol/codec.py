"""encode(msg) -> frames and decode(frames) -> msg, with validation against the message types.

Nothing from the network is ever unpickled: bodies are msgpack maps of plain values, and
``decode`` rebuilds the dataclasses field by field from their annotations, rejecting unknown,
missing or mistyped fields with a ``DecodeError`` that names the field.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Sequence
from functools import cache
from typing import Any, Union

import msgpack

from .messages import REGISTRY, FieldError, Message

MAX_BODY_BYTES = 64 << 20
MAX_FRAMES = 16
_MAX_STR = 1 << 20
_MAX_ITEMS = 1 << 20


class DecodeError(ValueError):
    """A message could not be decoded; ``field`` names the offending part (may be empty)."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field


def encode(msg: Message, frames: Sequence[Any] = ()) -> list[Any]:
    """Frames of a message: kind byte, msgpack body, then raw tensor frames (sent as is)."""
    lo, hi = msg.FRAMES
    if not lo <= len(frames) <= hi:
        raise ValueError(f"{type(msg).__name__} takes {lo}..{hi} tensor frames, got {len(frames)}")
    return [bytes((msg.KIND,)), msgpack.packb(_to_wire(msg), use_bin_type=True), *frames]


def decode(frames: Sequence[Any]) -> tuple[Message, list[memoryview]]:
    """Validate and rebuild a message; returns it with its tensor frames (as memoryviews)."""
    if len(frames) < 2:
        raise DecodeError(f"expected at least 2 frames (kind, body), got {len(frames)}", "frames")
    if len(frames) > MAX_FRAMES:
        raise DecodeError(f"too many frames ({len(frames)} > {MAX_FRAMES})", "frames")
    kind_frame = memoryview(frames[0])
    if kind_frame.nbytes != 1:
        raise DecodeError("first frame must be exactly one kind byte", "kind")
    cls = REGISTRY.get(kind_frame.tobytes()[0])
    if cls is None:
        raise DecodeError(f"unknown message kind {kind_frame.tobytes()[0]}", "kind")
    body = memoryview(frames[1])
    if body.nbytes > MAX_BODY_BYTES:
        raise DecodeError(f"body of {body.nbytes} bytes exceeds {MAX_BODY_BYTES}", "body")
    try:
        obj = msgpack.unpackb(
            body, raw=False, strict_map_key=True, max_str_len=_MAX_STR, max_bin_len=_MAX_STR,
            max_array_len=_MAX_ITEMS, max_map_len=_MAX_ITEMS, max_ext_len=0,
        )
    except Exception as e:  # msgpack raises several types for malformed input
        raise DecodeError(f"body is not valid msgpack: {e}", "body") from None
    msg = _from_wire(cls, obj, cls.__name__)
    extra = [memoryview(f) for f in frames[2:]]
    lo, hi = cls.FRAMES
    if not lo <= len(extra) <= hi:
        raise DecodeError(f"{cls.__name__} takes {lo}..{hi} tensor frames, got {len(extra)}",
                          "frames")
    return msg, extra


def peek_req_id(frames: Sequence[Any]) -> int:
    """Best-effort req_id of an undecodable message, so the Error reply can still be matched."""
    try:
        obj = msgpack.unpackb(memoryview(frames[1]), raw=False, max_str_len=_MAX_STR,
                              max_bin_len=_MAX_STR, max_array_len=_MAX_ITEMS,
                              max_map_len=_MAX_ITEMS, max_ext_len=0)
        rid = obj.get("req_id", 0)
        return rid if type(rid) is int and 0 <= rid < 1 << 63 else 0
    except Exception:
        return 0


# ----------------------------------------------------------------------------- to wire


def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


# ----------------------------------------------------------------------------- from wire


@cache
def _hints(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _from_wire(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _from_wire(arg, value, path)
            except DecodeError as e:
                errors.append(str(e))
        raise DecodeError(f"{path}: no alternative of {tp} matches ({'; '.join(errors)})",
                          path)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list):
            raise DecodeError(f"{path}: expected a list", path)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_from_wire(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise DecodeError(f"{path}: expected {len(args)} items", path)
        return tuple(_from_wire(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        key_t, val_t = typing.get_args(tp)
        if not isinstance(value, dict):
            raise DecodeError(f"{path}: expected a map", path)
        return {_from_wire(key_t, k, path): _from_wire(val_t, v, f"{path}.{k}")
                for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _dataclass_from_wire(tp, value, path)
    if tp is bool:
        if type(value) is not bool:
            raise DecodeError(f"{path}: expected a bool", path)
        return value
    if tp is int:
        if type(value) is not int:
            raise DecodeError(f"{path}: expected an int", path)
        return value
    if tp is float:
        if type(value) not in (int, float):
            raise DecodeError(f"{path}: expected a number", path)
        return float(value)
    if tp is str:
        if type(value) is not str:
            raise DecodeError(f"{path}: expected a string", path)
        return value
    if tp is bytes:
        if type(value) is not bytes:
            raise DecodeError(f"{path}: expected bytes", path)
        return value
    raise TypeError(f"unsupported field type {tp} at {path}")  # a bug in messages.py


def _dataclass_from_wire(cls: type, value: Any, path: str) -> Any:
    if not isinstance(value, dict):
        raise DecodeError(f"{path}: expected a map", path)
    hints = _hints(cls)
    unknown = set(value) - set(hints)
    if unknown:
        name = sorted(map(str, unknown))[0]
        raise DecodeError(f"{path}: unknown field {name!r}", f"{path}.{name}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in value:
            kwargs[f.name] = _from_wire(hints[f.name], value[f.name], f"{path}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise DecodeError(f"{path}: missing field {f.name!r}", f"{path}.{f.name}")
    try:
        return cls(**kwargs)
    except FieldError as e:
        raise DecodeError(f"{path}.{e}", f"{path}.{e.field}") from None
    except (ValueError, TypeError) as e:
        raise DecodeError(f"{path}: {e}", path) from None
