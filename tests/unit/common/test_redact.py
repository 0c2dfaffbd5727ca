"""Session tokens and API keys are redacted from text, raw output, JSON and structs."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import msgspec

from schemas import Artifacts, Outcome, Trace, Trajectory
from services.common.redact import (
    REDACTED,
    RedactFilter,
    Scrubber,
    known_secrets,
    redact,
    redact_bytes,
    redact_struct,
    redact_value,
)
from services.common.registry import new_token

REPO = Path(__file__).resolve().parents[3]
TOKEN = new_token()
# What a codex session stored as its reason (issue 13), with a real-shaped token.
CODEX = (
    "codex exited with code 1: stream error: error sending request for url "
    f"(http://127.0.0.1:40309/s/{TOKEN}/v1/responses)"
)


def test_a_session_token_in_a_reason_keeps_its_prefix_and_loses_its_secret():
    got = redact(CODEX)
    assert TOKEN not in got
    assert got.endswith(f"(http://127.0.0.1:40309/s/ps_{REDACTED}/v1/responses)")


def test_provider_keys_and_named_secrets():
    cases = {
        "OPENAI_API_KEY=sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv": f"OPENAI_API_KEY={REDACTED}",
        "x-api-key: sk-ant-api03-AAAABBBBCCCCDDDDEEEE": f"x-api-key: {REDACTED}",
        "Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30.abc": f"Authorization: Bearer {REDACTED}",
        "key=AIzaSyA1234567890abcdefghijklmnopqrstu": f"key={REDACTED}",
        '{"api_key": "hunter2hunter2"}': f'{{"api_key": "{REDACTED}"}}',
        "HF_TOKEN hf_abcdefghijklmnopqrstuvwxyzABCDEF": f"HF_TOKEN {REDACTED}",
        "aws AKIAIOSFODNN7EXAMPLE here": f"aws {REDACTED} here",
    }
    for text, want in cases.items():
        assert redact(text) == want, text


def test_ordinary_text_is_left_alone():
    for text in (
        "ps_aux shows 3 processes",  # too short to be a token
        "risk-assessment-framework-for-the-team-v2",  # 'sk-' inside a word
        "max_tokens: 1024, tokens_used=88",
        "the password is too short",
        "PASSED test_calc.py::test_add",
    ):
        assert redact(text) == text


def test_encoded_json_stays_valid_json():
    doc = {"reason": CODEX, "nested": [{"env": f"OPENAI_API_KEY={TOKEN}"}], "n": [1, 2]}
    out = json.loads(redact_bytes(json.dumps(doc).encode()))
    assert TOKEN not in json.dumps(out) and out["n"] == [1, 2]
    assert out["nested"][0]["env"] == f"OPENAI_API_KEY={REDACTED}"
    assert redact_value(doc) == out


def test_a_struct_is_redacted_everywhere_and_returned_as_is_when_clean():
    trace = Trace(
        trace_id="t/0",
        prompt_ids=[1, 2],
        response_ids=[3],
        loss_mask=[1],
        response_logprobs=[-0.1],
        messages=[{"role": "tool", "content": f"OPENAI_BASE_URL=http://h/s/{TOKEN}/v1"}],
    )
    traj = Trajectory(
        session_id="s",
        task_id="t",
        outcome=Outcome.ERROR,
        builder="per_request",
        traces=[trace],
        eval_reason=CODEX,
        metadata={"note": TOKEN},
    )
    clean = redact_struct(traj)
    assert TOKEN not in msgspec.json.encode(clean).decode()
    assert clean.traces[0].prompt_ids == [1, 2]  # ids stay as sampled
    assert clean.traces[0].messages[0]["content"] == f"OPENAI_BASE_URL=http://h/s/ps_{REDACTED}/v1"
    plain = Artifacts(stdout_tail="all good")
    assert redact_struct(plain) is plain


def test_the_log_filter_redacts_message_args_and_traceback():
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(self.format(record))

    handler = Keep()
    handler.addFilter(RedactFilter())
    log = logging.getLogger("test.redact")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("run of %s failed: %s", "s-0001", CODEX)
        try:
            raise RuntimeError(f"POST http://127.0.0.1:1/s/{TOKEN}/v1/messages: 529")
        except RuntimeError:
            log.exception("call failed")
    finally:
        log.removeHandler(handler)
    text = "\n".join(records)
    assert TOKEN not in text
    assert f"/s/ps_{REDACTED}/v1/responses" in text and f"/s/ps_{REDACTED}/v1/messages" in text


def test_every_service_process_logs_through_the_filter():
    """The logging every service's Litestar app is built with, in a process of its own."""
    code = (
        "import logging; from services.common.logs import service_logging\n"
        "service_logging().configure()\n"
        f"logging.getLogger('services.executor').warning('reason: %s', {CODEX!r})\n"
        "logging.getLogger('httpx').info('HTTP Request: GET http://e/metrics 404')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert TOKEN not in out and f"/s/ps_{REDACTED}/v1/responses" in out
    assert "HTTP Request" not in out  # http clients log quietly


def test_the_scrubber_hides_known_values_and_shapes_in_plain_data():
    secret = 'pass"word\\value'  # a quote and a backslash: JSON writes it escaped
    scrub = Scrubber([TOKEN, TOKEN.removeprefix("ps_"), secret, "short"])
    request_text = json.dumps({"content": f"env: DB={secret} key {TOKEN.removeprefix('ps_')}"})
    body = {
        "stdout": f"my token {TOKEN} and {secret}",
        "calls": [{"request": {"text": request_text}}, 7, None],
        "short": "short",  # under MIN_KNOWN: left alone, ordinary words stay
    }
    out = scrub.value(body)
    assert out["stdout"] == f"my token ps_{REDACTED} and {REDACTED}"
    assert TOKEN.removeprefix("ps_") not in out["calls"][0]["request"]["text"]
    assert "pass" not in out["calls"][0]["request"]["text"]
    assert out["calls"][1:] == [7, None] and out["short"] == "short"
    assert Scrubber().value({"a": f"x {TOKEN}"}) == {"a": f"x ps_{REDACTED}"}  # shapes only
    text = f"ab {TOKEN} cd {secret}"
    spans = scrub.spans(text)
    assert (text.index(TOKEN), text.index(TOKEN) + len(TOKEN)) in spans
    assert (text.index(secret), len(text)) in spans


def test_known_secrets_of_a_session():
    from schemas import TaskRequest

    spec = msgspec.convert(
        {
            "instruction": "x",
            "agent": {"harness": "shell", "command": "true", "env": {"A": "agent-secret"}},
            "runtime": {
                "backend": "local",
                "env": {"B": "runtime-secret"},
                "prepare": [{"action": "exec", "command": "true", "env": {"C": "prep-secret"}}],
            },
        },
        TaskRequest,
    )
    assert known_secrets(TOKEN, spec) == [
        TOKEN,
        TOKEN.removeprefix("ps_"),
        "agent-secret",
        "runtime-secret",
        "prep-secret",
    ]
    assert known_secrets(None, spec)[0] == "agent-secret"
    assert known_secrets(TOKEN, None) == [TOKEN, TOKEN.removeprefix("ps_")]
