"""``rubric``: an LLM judge scores each trace against a rubric; the score joins the reward.

The judge is any OpenAI-compatible Chat Completions endpoint: the engine the proxy
itself serves from (its ``/v1``, e.g. the embedded model server or a vLLM / SGLang
backend), or a hosted model. Each call is recorded as one of the judged session's
``CompletionRecord``s (through ``ctx.side_calls``: numbered after the harness's calls,
published on ``polar.completions.<session>``) tagged ``side_call: "judge"``, with the
request, the reply and, for a call that failed, its ``error``; no token ids (a hosted
judge gives none). The evaluator runs after the trajectory was built, so no trajectory
holds them, and a rebuild from the records (the dashboard's) makes them side-call traces
with nothing to train on. The result's ``judge_calls`` names each call's record (``seq``)
with the trace, model, score, the reply's head and seconds. An evaluation run again after
a crash (its result not yet kept) asks the judge again: both rounds are recorded.

Config::

    url: http://127.0.0.1:30000/v1      # OpenAI-compatible base URL (required)
    model: judge-model                   # required
    api_key_env: JUDGE_API_KEY           # optional: the variable holding the key (never the key)
    rubric: "The agent fixed the bug without touching the tests."   # required
    scale: [0, 10]                       # the judge's score range (default 0..10)
    coefficient: 0.5                     # weight of the normalized score (default 1.0)
    base: {name: test_on_output, config: {...}}   # optional: the reward it is mixed into
    timeout_seconds: 60                  # per judge call
    max_tokens: 64
    max_transcript_chars: 12000          # the transcript's tail the judge reads

Each main-loop trace (side calls are not judged) is scored ``s`` on the scale; its reward
is ``base + coefficient * (s - lo) / (hi - lo)`` where ``base`` is the base evaluator's
reward for that trace (0 without one). The session's reward is the base's plus the
coefficient times the mean normalized score. The judge must answer ``SCORE: <number>``
(or JSON ``{"score": n}``) inside the scale: a reply without one, a score outside the
scale, an HTTP error or a timeout is an evaluator error naming the trace, never a 0; so
is a judge call whose record cannot be committed.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from msgspec import Raw

from evaluators.base import EvalContext, EvalResult, Evaluator, EvaluatorError, checked
from schemas import CompletionRecord, Protocol, Timings, Trace, Trajectory, UpstreamMode

JUDGE_SIDE_CALL = "judge"  # the records' ``side_call`` tag
USER_AGENT = "polar-evaluator/rubric"
SCORE_LINE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
JUDGE_SYSTEM = (
    "You are a strict grader of an AI agent's work. Read the rubric, the task and the "
    "agent's transcript, then answer with exactly one line: SCORE: <number from {lo:g} "
    "to {hi:g}>."
)


@dataclass(frozen=True)
class JudgeConfig:
    url: str
    model: str
    rubric: str
    lo: float
    hi: float
    coefficient: float
    timeout: float
    max_tokens: int
    max_chars: int
    api_key: str | None


def judge_config(config: dict[str, Any]) -> JudgeConfig:
    missing = [k for k in ("url", "model", "rubric") if not config.get(k)]
    if missing:
        raise EvaluatorError(f"rubric config lacks {', '.join(missing)}")
    scale = config.get("scale", [0, 10])
    if (
        not isinstance(scale, list | tuple)
        or len(scale) != 2
        or not all(isinstance(v, int | float) for v in scale)
        or scale[0] >= scale[1]
    ):
        raise EvaluatorError(f"rubric `scale` must be [low, high] with low < high, not {scale!r}")
    key_env = config.get("api_key_env")
    api_key = None
    if key_env:
        api_key = os.environ.get(str(key_env))
        if not api_key:
            raise EvaluatorError(f"rubric: ${key_env} (api_key_env) is not set")
    return JudgeConfig(
        url=str(config["url"]).rstrip("/"),
        model=str(config["model"]),
        rubric=str(config["rubric"]),
        lo=float(scale[0]),
        hi=float(scale[1]),
        coefficient=float(config.get("coefficient", 1.0)),
        timeout=float(config.get("timeout_seconds", 60.0)),
        max_tokens=int(config.get("max_tokens", 64)),
        max_chars=int(config.get("max_transcript_chars", 12000)),
        api_key=api_key,
    )


def transcript(trace: Trace, max_chars: int) -> str:
    """The trace's conversation as plain text, its tail when long (the answer is last)."""
    lines = []
    for m in trace.messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        text = content if isinstance(content, str) else ""
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {}) if isinstance(call, dict) else {}
            text += f"\n[tool call {fn.get('name')}: {fn.get('arguments')}]"
        lines.append(f"## {m.get('role')}\n{text}")
    text = "\n\n".join(lines)
    return text if len(text) <= max_chars else "[...]\n" + text[-max_chars:]


def judge_messages(cfg: JudgeConfig, instruction: str, trace: Trace) -> list[dict[str, str]]:
    user = (
        f"# Rubric\n{cfg.rubric}\n\n# Task\n{instruction}\n\n"
        f"# Transcript\n{transcript(trace, cfg.max_chars)}\n\n"
        f"Answer with one line: SCORE: <number from {cfg.lo:g} to {cfg.hi:g}>."
    )
    return [
        {"role": "system", "content": JUDGE_SYSTEM.format(lo=cfg.lo, hi=cfg.hi)},
        {"role": "user", "content": user},
    ]


def parse_score(reply: str, lo: float, hi: float) -> float:
    """The judge's score; raises EvaluatorError when the reply holds none in [lo, hi]."""
    score = None
    try:
        doc = json.loads(reply)
        if isinstance(doc, dict) and isinstance(doc.get("score"), int | float):
            score = float(doc["score"])
    except ValueError:
        pass
    if score is None:
        found = SCORE_LINE.findall(reply)
        if found:
            score = float(found[-1])  # a judge that reasons first gives its verdict last
    if score is None:
        raise EvaluatorError(f"the judge's reply holds no score: {reply[:200]!r}")
    if not lo <= score <= hi:
        raise EvaluatorError(f"the judge's score {score:g} is outside the scale [{lo:g}, {hi:g}]")
    return score


@dataclass(frozen=True)
class JudgeReply:
    content: str
    served_model: str
    finish_reason: str


def request_body(cfg: JudgeConfig, messages: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "model": cfg.model,
        "messages": messages,
        "max_tokens": cfg.max_tokens,
        "temperature": 0.0,
    }


async def ask_judge(client: httpx.AsyncClient, cfg: JudgeConfig, body: dict) -> JudgeReply:
    headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    try:
        resp = await client.post(
            cfg.url + "/chat/completions", json=body, headers=headers, timeout=cfg.timeout
        )
    except httpx.TimeoutException:
        raise EvaluatorError(f"the judge did not answer within {cfg.timeout:g}s") from None
    except httpx.HTTPError as exc:
        raise EvaluatorError(f"the judge at {cfg.url} is unreachable: {exc!r}") from None
    if resp.status_code != 200:
        raise EvaluatorError(f"the judge answered HTTP {resp.status_code}: {resp.text[:200]}")
    try:
        doc = resp.json()
        choice = doc["choices"][0]
        content = choice["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise EvaluatorError(
            f"the judge's answer is not a chat completion: {resp.text[:200]}"
        ) from None
    return JudgeReply(
        content if isinstance(content, str) else "",
        str(doc.get("model") or ""),
        str(choice.get("finish_reason") or "stop"),
    )


def judge_record(
    trajectory: Trajectory,
    seq: int,
    body: dict[str, Any],
    sent: float,
    reply: JudgeReply | None,
    error: str | None = None,
) -> CompletionRecord:
    """One judge call as a record of the judged session: what was asked, what came
    back (or why nothing did), tagged as a side call."""
    now = time.time()
    answer = {"role": "assistant", "content": reply.content} if reply else None
    return CompletionRecord(
        session_id=trajectory.session_id,
        seq=seq,
        attempt=trajectory.attempt,
        protocol=Protocol.OPENAI_CHAT,
        mode=UpstreamMode.CHAT,
        model=body["model"],
        served_model=reply.served_model if reply else "",
        raw_request=Raw(orjson.dumps(body)),
        normalized=Raw(orjson.dumps({"messages": body["messages"], "tools": []})),
        reply=Raw(orjson.dumps(answer)),
        finish_reason=reply.finish_reason if reply else "error",
        timings=Timings(received=sent, upstream_start=sent, upstream_end=now, captured=now),
        user_agent=USER_AGENT,
        side_call=JUDGE_SIDE_CALL,
        error=error,
    )


async def recorded(
    ctx: EvalContext, body: dict, sent: float, reply: JudgeReply | None, error: str | None = None
) -> int | None:
    """Record the call as the session's side call; its seq (None with nowhere to record)."""
    if ctx.side_calls is None:
        return None
    seq = await ctx.side_calls.number()
    await ctx.side_calls.commit(judge_record(ctx.trajectory, seq, body, sent, reply, error))
    return seq


async def judge_trace(
    client: httpx.AsyncClient, cfg: JudgeConfig, ctx: EvalContext, trace: Trace
) -> dict[str, Any]:
    """Ask the judge about one trace and record the call, answered or not: the call's
    summary (``judge_calls``' entry). Raises EvaluatorError for a call that failed, a
    reply without a score in the scale, or a call that could not be recorded."""
    body = request_body(cfg, judge_messages(cfg, ctx.task.instruction, trace))
    sent, started = time.time(), time.monotonic()
    try:
        reply = await ask_judge(client, cfg, body)
    except EvaluatorError as exc:
        try:
            await recorded(ctx, body, sent, None, str(exc))
        except EvaluatorError as lost:
            raise EvaluatorError(f"{exc} ({lost})") from None
        raise
    seq = await recorded(ctx, body, sent, reply)
    return {
        "side_call": JUDGE_SIDE_CALL,
        "seq": seq,
        "trace_id": trace.trace_id,
        "model": cfg.model,
        "score": parse_score(reply.content, cfg.lo, cfg.hi),
        "reply": reply.content[:500],
        "seconds": round(time.monotonic() - started, 3),
    }


async def base_result(ctx: EvalContext) -> EvalResult | None:
    """The reward the score is mixed into: the ``base`` evaluator's, run in this context."""
    spec = ctx.config.get("base")
    if spec is None:
        return None
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise EvaluatorError("rubric `base` must be {name: <evaluator>, config: {...}}")
    from evaluators.registry import create_evaluator, default_registry  # the registry holds us

    name = spec["name"]
    if name == "rubric":
        raise EvaluatorError("rubric `base` cannot be rubric itself")
    inner = create_evaluator(default_registry(), name)
    sub = EvalContext(
        trajectory=ctx.trajectory,
        artifacts=ctx.artifacts,
        task=ctx.task,
        config=dict(spec.get("config") or {}),
        runtime=ctx.runtime,
        runtime_kind=ctx.runtime_kind,
        deadline=ctx.deadline,
        notes=ctx.notes,
        side_calls=ctx.side_calls,
    )
    result = checked(await inner.evaluate(sub), name, len(ctx.trajectory.traces))
    if result.status != "ok":
        raise EvaluatorError(f"base evaluator {name!r}: {result.reason}")
    return result


class Rubric(Evaluator):
    name = "rubric"
    needs_runtime = "task"  # the base evaluator may need one; the judge itself does not

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        cfg = judge_config(ctx.config)
        base = await base_result(ctx)
        traces = ctx.trajectory.traces
        base_session = base.reward if base else 0.0
        base_traces = list(base.trace_rewards or [base_session] * len(traces)) if base else []
        calls: list[dict[str, Any]] = []
        normalized: list[float | None] = []
        async with httpx.AsyncClient() as client:
            for i, trace in enumerate(traces):
                if trace.side_call:
                    normalized.append(None)
                    continue
                try:
                    call = await judge_trace(client, cfg, ctx, trace)
                except EvaluatorError as exc:
                    raise EvaluatorError(f"trace {i} ({trace.trace_id}): {exc}") from None
                calls.append(call)
                normalized.append((call["score"] - cfg.lo) / (cfg.hi - cfg.lo))
        judged = [n for n in normalized if n is not None]
        if not judged:
            raise EvaluatorError("no main-loop trace to judge (only side calls)")
        mean = sum(judged) / len(judged)
        reward = base_session + cfg.coefficient * mean
        trace_rewards = [
            (base_traces[i] if base else 0.0) + cfg.coefficient * (n if n is not None else mean)
            for i, n in enumerate(normalized)
        ]
        return EvalResult.per_trace(
            reward,
            trace_rewards,
            f"judge mean {cfg.lo + mean * (cfg.hi - cfg.lo):g} on [{cfg.lo:g}, {cfg.hi:g}]",
            judge_scores=[c["score"] for c in calls],
            judge_calls=calls,
            coefficient=cfg.coefficient,
            base_reward=base.reward if base else None,
            base_reason=base.reason if base else None,
        )
