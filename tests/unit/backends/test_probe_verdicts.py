"""proxy.backends.probe: which probe failures are waited for and which are final."""

import pytest

from proxy.backends.base import BackendCapabilityError, BackendError, ErrorKind
from proxy.backends.errors import error_from_response
from proxy.backends.probe import PROBE_MESSAGES, not_ready, probe_refused, prompt_ids


@pytest.mark.parametrize(
    ("status", "body", "waits"),
    [
        (503, b'{"error": "loading"}', True),
        (502, b"bad gateway", True),
        (504, b"", True),
        (429, b"", True),
        (500, b'{"error": {"message": "token id 0 is outside the vocabulary"}}', False),
        (400, b'{"message": "bad input_ids"}', False),
        (404, b'{"detail": "Not Found"}', False),
        (501, b"", False),
    ],
)
def test_answers(status, body, waits):
    assert not_ready(error_from_response(status, body, "http://e")) is waits


def test_no_answer_and_timeouts_wait_capability_refusals_do_not():
    assert not_ready(BackendError(ErrorKind.UNAVAILABLE, "ConnectFailed: refused"))
    assert not_ready(BackendError(ErrorKind.TIMEOUT, "timed out"))
    assert not not_ready(BackendCapabilityError("no token ids"))


def test_a_refusal_names_the_engine_status_and_reason():
    exc = probe_refused(error_from_response(500, b'{"error": "no such token"}', "http://e:1"))
    assert isinstance(exc, BackendCapabilityError) and not exc.retryable
    assert exc.message.startswith("http://e:1 refused the start-up probe (HTTP 500): no such token")


def test_prompt_ids_are_the_templated_probe_message():
    class Tok:
        def render_ids(self, messages):
            assert messages == PROBE_MESSAGES
            return [5, 6]

    assert prompt_ids(Tok()) == [5, 6]
