"""Errors the proxy turns into replies in the caller's own protocol.

    ProxyError                 status + message + kind (+ param)
      ├── ProtocolError        the harness sent something we cannot serve: a 4xx
      │     └── PromptTooLong  a prompt that cannot fit the model's context (a 400)
      └── UpstreamError        the backend or the capture failed: kind picks the status

Each protocol maps an ``ErrorKind`` to its own status and error type (``error_body``);
nothing reaches a harness as a bare 500.
"""

from __future__ import annotations

import enum


class ErrorKind(enum.StrEnum):
    BAD_REQUEST = "bad_request"
    UNAUTHORIZED = "unauthorized"
    NOT_FOUND = "not_found"
    TOO_LARGE = "too_large"
    CONTEXT_LENGTH = "context_length"
    OVERLOADED = "overloaded"
    UNAVAILABLE = "unavailable"
    CAPTURE_FAILED = "capture_failed"
    INTERNAL = "internal"


# The status a kind gets unless a protocol says otherwise (Anthropic: 529 for overload).
DEFAULT_STATUS: dict[ErrorKind, int] = {
    ErrorKind.BAD_REQUEST: 400,
    ErrorKind.UNAUTHORIZED: 401,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.TOO_LARGE: 413,
    ErrorKind.CONTEXT_LENGTH: 400,
    ErrorKind.OVERLOADED: 503,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.CAPTURE_FAILED: 503,  # nothing was recorded: the harness must retry
    ErrorKind.INTERNAL: 500,
}

_KIND_OF_STATUS = {
    400: ErrorKind.BAD_REQUEST,
    401: ErrorKind.UNAUTHORIZED,
    404: ErrorKind.NOT_FOUND,
    413: ErrorKind.TOO_LARGE,
}


class ProxyError(Exception):
    def __init__(self, status: int, message: str, kind: ErrorKind, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param


class ProtocolError(ProxyError):
    """Bad input from the harness (400 unless said otherwise)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(status, message, _KIND_OF_STATUS.get(status, ErrorKind.BAD_REQUEST), param)


class PromptTooLong(ProtocolError):
    """A prompt that cannot fit the model's context: the 400 of kind ``context_length``
    that an engine answers for one, given by the proxy before it templates the prompt."""

    def __init__(self, message: str):
        ProxyError.__init__(self, 400, message, ErrorKind.CONTEXT_LENGTH)


class UpstreamError(ProxyError):
    """A failure behind the proxy. ``kind``: bad_request | context_length | unavailable |
    overloaded | capture_failed. ``status`` is the upstream's own status, kept for logs;
    the reply's status comes from the kind and the caller's protocol."""

    def __init__(self, status: int, message: str, kind: ErrorKind | str = ErrorKind.UNAVAILABLE):
        super().__init__(status, message, ErrorKind(kind))
