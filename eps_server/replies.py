"""What the core answers: replies addressed to a peer (its ZeroMQ routing identity)."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.messages import Error, Message


@dataclass(frozen=True)
class Out:
    """A reply to send: to ``peer``, ``msg`` with tensor ``frames``."""

    peer: bytes
    msg: Message
    frames: tuple = ()


def error_out(peer: bytes, req_id: int, code: str, message: str, field: str = "") -> Out:
    return Out(peer, Error(req_id=req_id, code=code, message=message, field=field))
