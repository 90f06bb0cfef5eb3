"""encode(msg) -> frames and decode(frames) -> msg, with validation against the message types.

Nothing from the network is ever unpickled: bodies are msgpack maps of plain values, and
``decode`` rebuilds the dataclasses field by field from their annotations, rejecting unknown,
missing or mistyped fields with a ``DecodeError`` that names the field. A Hello's manifest
(up to 4 MiB, ~0.5 s to rebuild at 1.3 MB) is rebuilt once for the same bytes (see _Known).
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import types
import typing
from collections import OrderedDict
from collections.abc import Sequence
from functools import cache
from typing import Any, Union

import msgpack

from .messages import REGISTRY, FieldError, Message

MAX_BODY_BYTES = 64 << 20  # no kind's limit (messages.py) is above this
MAX_FRAMES = 16
MAX_OBJECTS = 1 << 18  # containers (arrays, maps) one body may decode to
_MAX_STR = 1 << 20
_MAX_ITEMS = 1 << 20
KNOWN_FIELDS = ("manifest",)  # fields a peer may send again and again, large: see _Known
KNOWN_KEPT = 2  # such values remembered, the latest used (a 4 MiB manifest holds ~20 MB)


class DecodeError(ValueError):
    """A message could not be decoded; ``field`` names the offending part (may be empty).
    ``req_id`` and ``protocol_version`` are those of the body when it was a map holding them
    as ints (so an Error reply can be matched, and another version's Hello told so)."""

    def __init__(self, message: str, field: str = "", req_id: int = 0,
                 protocol_version: int | None = None):
        super().__init__(message)
        self.field, self.req_id, self.protocol_version = field, req_id, protocol_version


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
    if body.nbytes > cls.BODY_LIMIT:
        raise DecodeError(f"{cls.__name__} body of {body.nbytes} bytes exceeds its limit of "
                          f"{cls.BODY_LIMIT}", "body")
    obj, ints = _unpack(body, _hints(cls))
    req_id, version = ints.get("req_id", 0), ints.get("protocol_version")
    try:
        for name, value in obj.items():
            if type(value) is _Fresh:
                obj[name] = _KNOWN.put(value.digest, _Known.of(_hints(cls)[name], value.value,
                                                              name))
        msg = _from_wire(cls, obj, "")
    except DecodeError as e:
        raise DecodeError(f"{cls.__name__}.{e}", e.field, req_id, version) from None
    extra = [memoryview(f) for f in frames[2:]]
    lo, hi = cls.FRAMES
    if not lo <= len(extra) <= hi:
        raise DecodeError(f"{cls.__name__} takes {lo}..{hi} tensor frames, got {len(extra)}",
                          "frames", req_id, version)
    return msg, extra


def request_id(frames: Sequence[Any]) -> int:
    """The ``req_id`` of a message left unread (a reply refuses it): its body's first entry, where
    the protocol puts it; 0 when it is not there as a valid one."""
    try:
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=32, max_str_len=16,
                                    max_bin_len=0, max_array_len=0, max_map_len=0, max_ext_len=0)
        unpacker.feed(memoryview(frames[1])[:32])
        unpacker.read_map_header()
        if unpacker.unpack() == "req_id":
            value = unpacker.unpack()
            if type(value) is int and 0 <= value < 1 << 63:
                return value
    except Exception:  # not a map, a short body, a large first entry...: no id
        pass
    return 0


class _Known:
    """A field's value decoded (and checked) before: a Hello's manifest, from a cache keyed by
    the sha256 of its bytes. A peer that sends the same large manifest again and again (every
    worker of a job sends the same; a hostile peer may send it in a flood) costs one decode;
    the next ones cost a digest (hashlib works without the GIL) and a skim over the bytes."""

    __slots__ = ("value", "error")

    def __init__(self, value: Any = None, error: DecodeError | None = None):
        self.value, self.error = value, error

    @staticmethod
    def of(tp: Any, value: Any, path: str) -> _Known:
        try:
            return _Known(_from_wire(tp, value, path))
        except DecodeError as e:
            return _Known(error=e)

    def get(self) -> Any:
        if self.error is not None:  # a new exception each time: no traceback accumulates
            raise DecodeError(str(self.error), self.error.field)
        return self.value


class _Fresh:
    """A known field's plain value, not in the cache yet (``digest``: of its bytes)."""

    __slots__ = ("value", "digest")

    def __init__(self, value: Any, digest: bytes):
        self.value, self.digest = value, digest


class _Cache:
    def __init__(self, size: int):
        self.size, self.items, self.lock = size, OrderedDict(), threading.Lock()

    def get(self, key: bytes) -> _Known | None:
        with self.lock:
            found = self.items.get(key)
            if found is not None:
                self.items.move_to_end(key)
            return found

    def put(self, key: bytes, value: _Known) -> _Known:
        with self.lock:
            self.items[key] = value
            self.items.move_to_end(key)
            while len(self.items) > self.size:
                self.items.popitem(last=False)
        return value


_KNOWN = _Cache(KNOWN_KEPT)


def _unpack(body: memoryview, fields: dict[str, Any]) -> tuple[Any, dict[str, int]]:
    """msgpack of plain values, in one pass, at most MAX_OBJECTS containers (a few bytes of
    msgpack can stand for an empty array that costs a hundred bytes of memory). The top-level
    map is read entry by entry, so its ``req_id`` and ``protocol_version`` (sent first) are
    known even when a later entry is refused: they come back in the DecodeError. A known field
    (KNOWN_FIELDS, of ``fields``) comes back as a _Known from the cache, else as a _Fresh."""
    count = 0
    ints: dict[str, int] = {}

    def counted(value):
        nonlocal count
        count += 1
        if count > MAX_OBJECTS:
            raise DecodeError(f"body holds more than {MAX_OBJECTS} arrays and maps", "body",
                              ints.get("req_id", 0), ints.get("protocol_version"))
        return value

    def reader(data: memoryview):
        unpacker = msgpack.Unpacker(
            raw=False, strict_map_key=True, max_buffer_size=max(data.nbytes, 1),
            max_str_len=_MAX_STR, max_bin_len=_MAX_STR, max_array_len=_MAX_ITEMS,
            max_map_len=_MAX_ITEMS, max_ext_len=0, list_hook=counted, object_hook=counted)
        unpacker.feed(data)
        return unpacker

    unpacker = reader(body)
    try:
        try:
            entries = unpacker.read_map_header()
        except (ValueError, TypeError, msgpack.UnpackException):
            raise DecodeError("body: expected a map", "body") from None
        obj = {}
        for _ in range(entries):
            key = unpacker.unpack()
            if not isinstance(key, str):
                raise DecodeError("body: map keys must be strings", "body")
            if key in KNOWN_FIELDS and key in fields:  # skimmed: its bytes are its key
                start = unpacker.tell()
                unpacker.skip()
                data = body[start:unpacker.tell()]
                digest = hashlib.sha256(data).digest()
                obj[key] = _KNOWN.get(digest) or _Fresh(reader(data).unpack(), digest)
                continue
            value = unpacker.unpack()
            obj[key] = value
            if key in ("req_id", "protocol_version") and type(value) is int and value >= 0:
                ints[key] = value if value < 1 << 63 else 0
        try:
            unpacker.unpack()
        except msgpack.OutOfData:
            return obj, ints
        raise DecodeError("body: data after the message", "body")
    except DecodeError:
        raise
    except Exception as e:  # msgpack raises several types for malformed input
        raise DecodeError(f"body is not valid msgpack: {str(e) or type(e).__name__}", "body",
                          ints.get("req_id", 0),
                          ints.get("protocol_version")) from None


# ----------------------------------------------------------------------------- to wire


def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for name, omit, default in _wire_fields(type(value)):
            v = getattr(value, name)
            if not omit or v != default:
                out[name] = _to_wire(v)
        return out
    if isinstance(value, (tuple, list)):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


@cache
def _wire_fields(cls: type) -> tuple[tuple[str, bool, Any], ...]:
    """Each field's name, whether it is left off the wire at its default, and that default (a
    field added to a message later: a peer that refuses unknown fields still reads the message
    as long as the field is not used)."""
    return tuple((f.name, bool(f.metadata.get("omit_default")), f.default)
                 for f in dataclasses.fields(cls))


# ----------------------------------------------------------------------------- from wire


@cache
def _hints(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _err(path: str, what: str) -> DecodeError:
    where = path or "body"
    return DecodeError(f"{where}: {what}", where)


def _from_wire(tp: Any, value: Any, path: str) -> Any:
    """Rebuild a value of type ``tp``; error fields are paths relative to the message, e.g.
    ``layer`` or ``manifest.layers[0].tensors[1].shape``."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(tp)):
            return None
        if len(args) == 1:  # Optional[X]: X's own error is the useful one
            return _from_wire(args[0], value, path)
        for arg in args:
            try:
                return _from_wire(arg, value, path)
            except DecodeError:
                pass
        raise _err(path, f"expected one of {', '.join(a.__name__ for a in args)}")
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list):
            raise _err(path, "expected a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_from_wire(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise _err(path, f"expected {len(args)} items")
        return tuple(_from_wire(a, v, f"{path}[{i}]")
                     for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        key_t, val_t = typing.get_args(tp)
        if not isinstance(value, dict):
            raise _err(path, "expected a map")
        return {_from_wire(key_t, k, path): _from_wire(val_t, v, _join(path, str(k)))
                for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _dataclass_from_wire(tp, value, path)
    if tp is bool:
        if type(value) is not bool:
            raise _err(path, "expected a bool")
        return value
    if tp is int:
        if type(value) is not int:
            raise _err(path, "expected an int")
        return value
    if tp is float:
        if type(value) not in (int, float):
            raise _err(path, "expected a number")
        return float(value)
    if tp is str:
        if type(value) is not str:
            raise _err(path, "expected a string")
        return value
    if tp is bytes:
        if type(value) is not bytes:
            raise _err(path, "expected bytes")
        return value
    raise TypeError(f"unsupported field type {tp} at {path}")  # a bug in messages.py


def _dataclass_from_wire(cls: type, value: Any, path: str) -> Any:
    if not isinstance(value, dict):
        raise _err(path, "expected a map")
    hints = _hints(cls)
    unknown = set(value) - set(hints)
    if unknown:
        name = sorted(map(str, unknown))[0]
        if len(name) > 64:  # (a peer's name, echoed in the Error and the log: kept short)
            name = f"{name[:48]}...({len(name)} characters)"
        raise _err(_join(path, name), "unknown field")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in value:
            v = value[f.name]
            kwargs[f.name] = (v.get() if type(v) is _Known
                              else _from_wire(hints[f.name], v, _join(path, f.name)))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise _err(_join(path, f.name), "missing field")
    try:
        return cls(**kwargs)
    except FieldError as e:
        raise _err(_join(path, e.field), e.what) from None
    except (ValueError, TypeError) as e:
        raise _err(path, str(e)) from None
