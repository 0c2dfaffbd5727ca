"""Engine error bodies of every known shape map to a message and a kind."""

from __future__ import annotations

import orjson
import pytest

from proxy.backends.base import ErrorKind
from proxy.backends.errors import classify, error_from_response, error_message

CTX = "The input (40000 tokens) is longer than the model's context length (32768 tokens)."


@pytest.mark.parametrize(
    "body",
    [
        {"object": "error", "message": CTX, "type": "BadRequestError", "param": None, "code": 400},
        {"error": {"message": CTX, "type": "BadRequestError", "param": None, "code": 400}},
        {"error": {"message": CTX}},
        {"detail": CTX},
        {"error": CTX},
    ],
)
def test_message_from_every_json_shape(body):
    assert error_message(orjson.dumps(body)) == CTX


def test_fastapi_validation_list_and_plain_text():
    body = {"detail": [{"loc": ["body", "messages"], "msg": "Field required", "type": "missing"}]}
    assert error_message(orjson.dumps(body)) == "Field required"
    assert error_message(b"Flush cache failed.\n") == "Flush cache failed."
    assert error_from_response(502, b"").message == "HTTP 502"


@pytest.mark.parametrize(
    ("status", "message", "kind"),
    [
        (400, CTX, ErrorKind.CONTEXT_LENGTH),
        (
            400,
            "This model's maximum context length is 4096 tokens. However, ...",
            ErrorKind.CONTEXT_LENGTH,
        ),
        (
            400,
            "Requested token count exceeds the model's maximum context length of 8",
            ErrorKind.CONTEXT_LENGTH,
        ),
        (400, "temperature must be non-negative", ErrorKind.BAD_REQUEST),
        (422, "bad", ErrorKind.BAD_REQUEST),
        (404, "Not Found", ErrorKind.NOT_FOUND),
        (429, "slow down", ErrorKind.OVERLOADED),
        (503, "The request queue is full.", ErrorKind.OVERLOADED),
        (503, "The server is shutting down.", ErrorKind.UNAVAILABLE),
        (504, "gateway", ErrorKind.TIMEOUT),
        (500, "CUDA error", ErrorKind.SERVER_ERROR),
    ],
)
def test_classification(status, message, kind):
    assert classify(status, message) is kind


def test_retryable_follows_kind():
    assert error_from_response(503, b'{"detail": "down"}').retryable
    assert not error_from_response(400, orjson.dumps({"detail": CTX})).retryable
