"""Session tokens and API keys never reach what people read: session reasons (the
registry and its events), the executor's artifacts and logs, the trajectory a trainer
gets and ``polar export``'s files. Real NATS JetStream, Valkey and local runtimes."""

from __future__ import annotations

import msgspec
import pytest

from schemas import EvaluatorSpec, Outcome, SessionState, TaskRequest, encode
from schemas import subjects as S
from services.common.registry import Registry
from services.evaluator.config import EvaluatorConfig
from services.evaluator.handlers import EvaluatorService
from services.evaluator.logic import trajectory_msg_id
from services.evaluator.main import consumers
from services.export.export import export
from services.node.session import SessionPaths
from services.scheduler import logic
from tests.helpers.node import Node, task
from tests.unit.evaluators.sessions import announce, delivered, new_sessions, unscored

pytestmark = pytest.mark.asyncio
REDACTED = "[redacted]"  # what a reader sees instead of a secret
SESSION_URL = f"/s/ps_{REDACTED}/"
API_KEY = "sk-proj-Zq8vL2mN5xR7tY1uW4eB6cD9fG3hJ0kA"
# A harness that fails the way codex did (issue 13): its error names the session URL,
# its stderr the key, its own log file the base URL.
LEAKY = (
    'echo "calling $OPENAI_BASE_URL/responses"; '
    'echo "error: stream error: error sending request for url ($OPENAI_BASE_URL/responses)'
    ' with OPENAI_API_KEY=$OPENAI_API_KEY" >&2; '
    'mkdir -p "$POLAR_LOG_DIR"; echo "base_url=$OPENAI_BASE_URL key=$EXTRA_KEY" > "$POLAR_LOG_DIR/agent.log"; '
    "exit 1"
)


def no_secret(text: str, *secrets: str) -> None:
    for secret in secrets:
        assert secret not in text


async def test_reasons_artifacts_logs_and_events_of_a_failed_run(fresh_servers, tmp_path):
    node = await Node.start(*fresh_servers, tmp_path / "work")
    try:
        spec = task("rd-run", agent={"command": LEAKY, "env": {"EXTRA_KEY": API_KEY}})
        (session,) = await node.scheduler.accept(logic.with_task_id(spec))
        await node.wait_finished(1, timeout=60)
        sid, token = session.session_id, session.token
        finished = node.finished[sid]
        record = await node.registry.get_session(sid)
        events = await node.events()
    finally:
        await node.stop()
    assert finished.outcome == Outcome.ERROR
    reason = finished.reason
    assert (
        reason.startswith("shell exited with code 1: error: stream error") and SESSION_URL in reason
    )
    no_secret(reason, token, API_KEY)
    assert record.reason == reason  # the registry keeps the redacted reason
    arts = finished.artifacts
    assert SESSION_URL in arts.stdout_tail and f"OPENAI_API_KEY={REDACTED}" in arts.stderr_tail
    no_secret(arts.stdout_tail + arts.stderr_tail, token, API_KEY)
    log = arts.logs["logs/agent.log"]
    assert SESSION_URL in log and f"key={REDACTED}" in log
    no_secret(log, token, API_KEY)
    logs_dir = SessionPaths.of(str(tmp_path / "work"), sid).logs
    for name in ("stdout.log", "stderr.log"):
        no_secret((logs_dir / name).read_text(), token, API_KEY)
    assert any(e.reason == reason for e in events)
    no_secret(msgspec.json.encode(events).decode(), token, API_KEY)


PLAIN_SECRET = "correct-horse-battery-staple"  # no shape marks it: known as task env
# A harness that prints its token without the `ps_` that marks it, its base URL so that
# the stdout tail starts in the middle of the token, and an env value in its own words.
SLY = (
    'echo "bare ${OPENAI_BASE_URL#*/s/ps_}"; echo "db is $DB_PASSPHRASE" >&2; '
    'printf "%s" "$OPENAI_BASE_URL" | sed "s|/v1$||"; printf "\\n%050d" 0'
)


async def test_stored_output_holds_no_token_even_unmarked_or_cut(fresh_servers, tmp_path):
    """Issue 17: harness stdout went into ``stdout_tail`` as printed."""
    node = await Node.start(*fresh_servers, tmp_path / "work", executor={"tail_bytes": 64})
    try:
        spec = task("rd-sly", agent={"command": SLY, "env": {"DB_PASSPHRASE": PLAIN_SECRET}})
        (session,) = await node.scheduler.accept(logic.with_task_id(spec))
        await node.wait_finished(1, timeout=60)
        finished = node.finished[session.session_id]
    finally:
        await node.stop()
    token, body = session.token, session.token.removeprefix("ps_")
    arts = finished.artifacts
    assert arts.stdout_tail.endswith("0" * 50) and len(arts.stdout_tail) == 64
    assert token[-12:] not in arts.stdout_tail  # the cut end of the token, unmarked
    logs_dir = SessionPaths.of(str(tmp_path / "work"), session.session_id).logs
    stored = (logs_dir / "stdout.log").read_text() + (logs_dir / "stderr.log").read_text()
    for text in (stored, arts.stdout_tail + arts.stderr_tail, finished.reason or ""):
        no_secret(text, token, body, PLAIN_SECRET)
    assert f"bare {REDACTED}" in stored and f"db is {REDACTED}" in stored


async def test_every_reason_the_registry_writes_is_redacted(redis_client):
    reg = Registry(redis_client)
    t = TaskRequest(task_id="rd-reg", instruction="x")
    (sid,) = await new_sessions(reg, t, to=("INITIALIZING",))
    token = (await reg.get_session(sid)).token
    moved = await reg.transition(
        sid,
        SessionState.ERROR,
        reason=f"POST http://127.0.0.1:1/s/{token}/v1/messages: 529",
        eval_reason=f"Authorization: Bearer {API_KEY}",
    )
    assert moved.ok
    s = await reg.get_session(sid)
    assert s.reason == f"POST http://127.0.0.1:1{SESSION_URL}v1/messages: 529"
    assert s.eval_reason == f"Authorization: Bearer {REDACTED}"


async def test_the_delivered_trajectory_has_no_secret(bus, redis_client, state_dir):
    reg = Registry(redis_client)
    t = TaskRequest(task_id="rd-traj", instruction="x", evaluator=EvaluatorSpec())
    (sid,) = await new_sessions(reg, t)
    token = (await reg.get_session(sid)).token
    raw = unscored(sid, "rd-traj")
    trace = raw.traces[0]
    leak = {"role": "tool", "content": f"$ env\nOPENAI_BASE_URL=http://h/s/{token}/v1\n"}
    raw = msgspec.structs.replace(
        raw,
        traces=[msgspec.structs.replace(trace, messages=[*trace.messages, leak])],
        metadata={**raw.metadata, "cli_error": f"x-api-key: {API_KEY}"},
    )
    await announce(bus, raw)
    service = EvaluatorService(bus, reg, EvaluatorConfig(work_dir=str(state_dir / "rdwork")))
    for c in consumers(service):
        await c.run(drain=True)
    (got,) = await delivered(bus, "rd-traj")
    no_secret(msgspec.json.encode(got).decode(), token, API_KEY)
    assert (
        got.traces[0].messages[-1]["content"] == f"$ env\nOPENAI_BASE_URL=http://h{SESSION_URL}v1\n"
    )
    assert got.traces[0].prompt_ids == trace.prompt_ids and got.reward == 1.0


async def test_export_redacts_what_was_stored_before(bus, tmp_path):
    """A trajectory stored with a token (by an older Polar, or another publisher)."""
    from services.common.registry import new_token

    token = new_token()
    t = unscored("rd-exp-0000", "rd-exp")
    t = msgspec.structs.replace(
        t,
        reward=1.0,
        eval_status="ok",
        traces=[
            msgspec.structs.replace(
                t.traces[0],
                messages=[{"role": "user", "content": f"use http://h/s/{token}/v1 key {API_KEY}"}],
            )
        ],
    )
    await bus.publish(
        S.trajectories("rd-exp"), encode(t), msg_id=trajectory_msg_id(t.session_id, 0)
    )
    out = tmp_path / "sft.jsonl"
    stats = await export(bus, out, task_id="rd-exp")
    text = out.read_text()
    assert stats.rows == 1 and SESSION_URL in text
    no_secret(text, token, API_KEY)
