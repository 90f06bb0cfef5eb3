"""Errors a request handler raises; each becomes an Error reply."""

from __future__ import annotations


class RequestError(Exception):
    """Turns into an Error reply; the request had no effect."""

    def __init__(self, code: str, message: str, field: str = ""):
        super().__init__(message)
        self.code, self.field = code, field
