"""CompletionRecord: one model call, captured token for token by the proxy.

Prompts are stored incrementally: when a call's prompt extends the previous call's
prompt + output (the common case in an agent loop), only the new tail is stored and
``prompt_base_seq`` names the record it extends. ``reconstruct_prompts`` rebuilds the
full prompts; records always stay self-describing and ordered by ``seq``.

Images are never in a record: ``images`` names each one by the digest of its bytes and
says where its tokens sit in the full prompt; the bytes are in the object store under
``subjects.image_object(digest)``, written before the record.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from msgspec import Raw, Struct

from schemas.routing import RoutedExperts


class Protocol(enum.StrEnum):
    OPENAI_CHAT = "openai_chat"
    OPENAI_RESPONSES = "openai_responses"
    ANTHROPIC_MESSAGES = "anthropic_messages"
    GEMINI = "gemini"


# One vocabulary for prompts that do not extend the previous call, on the record
# (``drift_reason``), on the trace (``Trace.break_reason``, services/builder/strategies/
# breaks.py) and on the dashboard. The sampled answer is not in the next prompt token for
# token:
RESPONSE_RETOKENIZED = "response_retokenized"  # the template renders the answer otherwise
REASONING_DROPPED = "reasoning_dropped"  # the model's reasoning left out of the history
HISTORY_RERENDERED = "history_rerendered"  # an earlier turn renders otherwise this time
# ... and, where the proxy can tell, why the answer itself changed (chat mode):
RESPONSE_DRIFT_CAUSES = (
    REASONING_DROPPED,  # the client did not send the model's thinking back
    "tool_arguments_reserialized",  # same JSON arguments, other spacing or key order
    "assistant_text_changed",  # e.g. stripped whitespace
)
# The history the model saw was re-rendered: the record names the cause, and the trace
# that starts there carries the same word (never a "compaction": nothing was shortened).
RERENDER_REASONS = (RESPONSE_RETOKENIZED, HISTORY_RERENDERED, *RESPONSE_DRIFT_CAUSES)
# Why a call continues none of its session's earlier calls (proxy/tito.classify_break).
NEW_CONVERSATION_REASONS = (
    "history_truncated",  # compaction, or a retry of an earlier turn
    "system_prompt_changed",  # a sub-agent, or a side call with its own prompt
    "tools_changed",
    "template_kwargs_changed",  # e.g. thinking turned off mid-conversation
    "new_conversation",
    "assistant_turn_rewritten",
    "history_rewritten",
)
DRIFT_REASONS = (*RERENDER_REASONS, *NEW_CONVERSATION_REASONS)


class UpstreamMode(enum.StrEnum):
    CHAT = "chat"  # the engine renders the chat template
    TOKEN = "token"  # the proxy renders it and sends input_ids (TITO)


class ImageSpan(Struct, frozen=True, kw_only=True):
    """One image of a prompt: its ``length`` image tokens start at ``start`` (an index
    into the full prompt ids, or into a trace's prompt + response ids)."""

    digest: str  # "sha256:<hex>" of the image's bytes as the harness sent them
    start: int  # index of its first image token
    length: int  # its image tokens
    media_type: str = ""  # as the harness declared it (image/png, ...)


class ToolParseFailure(Struct, frozen=True, kw_only=True):
    """Tool markup of the model's output that did not become a valid tool call."""

    # malformed (JSON/XML that does not parse, an unterminated block) | unknown_tool (a
    # name the request did not offer) | invalid_arguments (not the tool's JSON schema)
    kind: str
    detail: str  # what was wrong, in the parser's words
    start: int = -1  # token offsets into output_ids; -1: the call as a whole
    end: int = -1  # one past the last token; -1: the call as a whole


class ToolParse(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Parse health of a call that offered tools: did the model's tool markup parse?"""

    ok: bool  # every tool call parsed and checked
    family: str = ""  # the model family whose parser read it (docs/models.md)
    calls: int = 0  # tool calls parsed
    failures: list[ToolParseFailure] = []  # the ones that did not, in order


class ReplayMark(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A replay's call (``polar replay``): answered from a recorded session's call, not
    sampled (its tokens are that call's), or refused (``result``)."""

    session_id: str  # the recorded session
    attempt: int = 0  # the recorded session's attempt
    seq: int  # the recorded call's number
    # why the request differed from the recorded one where it did (a date, a timestamp,
    # a random id: proxy/replay_diff.py), when it did
    nondeterministic: list[str] = []
    trainable: bool = False  # its sampled tokens keep loss mask 1 (ReplaySpec.train)
    result: str = "replayed"  # REPLAY_RESULTS: what the replay did with the call


# ``ReplayMark.result``: answered from the recorded call; or a failed call whose error is
# the report: its request was not the recorded one, it came after one that was not, or
# the recorded call had failed too
REPLAYED, REPLAY_DIVERGED, REPLAY_REFUSED, REPLAY_FAILED = (
    "replayed",
    "diverged",
    "refused",
    "failed",
)
REPLAY_RESULTS = (REPLAYED, REPLAY_DIVERGED, REPLAY_REFUSED, REPLAY_FAILED)


class Timings(Struct, frozen=True, kw_only=True, omit_defaults=True):
    received: float  # epoch seconds
    upstream_start: float = 0.0  # epoch seconds: the request went to the engine
    upstream_end: float = 0.0  # the engine's answer was complete
    captured: float = 0.0  # the record was committed
    queue_ms: float = 0.0  # time spent waiting (pause, backpressure)


class CompletionRecord(Struct, frozen=True, kw_only=True, omit_defaults=True):
    v: int = 1  # the shape's version
    session_id: str  # the session that made the call
    seq: int  # 0, 1, 2, ... per session, in the order calls reached the engine
    attempt: int = 0  # the session attempt that made the call (a retried session appends)
    protocol: Protocol  # the model API the harness called
    mode: UpstreamMode  # who rendered the chat template: the engine (chat) or the proxy (token)
    model: str  # what the harness asked for (and is echoed back)
    served_model: str = ""  # the model the engine says it served
    raw_request: Raw = Raw(b"null")  # the harness's request body, verbatim JSON
    normalized: Raw = Raw(b"null")  # the normalized Conversation
    reply: Raw = Raw(b"null")  # the assistant message the proxy answered with (OpenAI shape)
    prompt_ids: list[int] = []  # full prompt, or the tail after the base (see module doc)
    # the record whose prompt + output this prompt extends; None: prompt_ids is whole
    prompt_base_seq: int | None = None
    prompt_base_len: int = 0  # tokens taken from base prompt + base output
    images: list[ImageSpan] = []  # every image of the full prompt, in order
    output_ids: list[int] = []  # the sampled token ids
    output_logprobs: list[float] = []  # the engine's logprob of each sampled id
    # stop | length | tool_calls (the turn called tools, in chat and token mode) | abort | error
    finish_reason: str = "stop"
    # the weights that sampled it, as the engine reports; None: not reported
    weight_version: str | None = None
    # A swap mid-call (engines that say so): weight_versions[i] produced output_ids from
    # weight_version_starts[i] on. Empty when one version produced the whole output.
    weight_versions: list[str] = []
    weight_version_starts: list[int] = []  # where each of weight_versions starts in output_ids
    # when it was received, sent to the engine, answered and captured
    timings: Timings | None = None
    user_agent: str | None = None  # the harness's User-Agent header
    # title | router | count_tokens | probe (the proxy's) | judge (an evaluator's call,
    # recorded after the build: services/evaluator/sidecalls.py) | None (main loop)
    side_call: str | None = None
    extends_previous: bool | None = None  # token mode: prompt == previous prompt + output + ...
    drift_reason: str | None = None  # why not, when it does not (DRIFT_REASONS)
    tool_parse: ToolParse | None = None  # None: no tools offered, or no parser at hand
    routing: RoutedExperts | None = None  # MoE expert routing (schemas/routing.py)
    replay: ReplayMark | None = None  # answered from a recorded call, not sampled
    # cut off mid-generation (the harness left, a cancel): output_ids is what came
    aborted: bool = False
    error: str | None = None  # failed before sampling anything (see ``void``)

    @property
    def void(self) -> bool:
        """Fills the number of a call that failed before anything was sampled (engine
        error, a prompt the template refused): no part of any trajectory, no lost call."""
        return self.error is not None and not self.aborted and not self.output_ids


def reconstruct_prompts(
    records: Iterable[CompletionRecord], missing: list[int] | None = None
) -> dict[int, list[int]]:
    """Full prompt ids per seq: the one rebuild of delta-encoded prompts (the builder's too).

    The first record of a seq wins; a void record (a failed call's number) has no prompt.
    A record whose base is absent raises KeyError, or, given a ``missing`` list, is left
    out with its seq appended there.
    """
    by_seq: dict[int, CompletionRecord] = {}
    for rec in records:
        by_seq.setdefault(rec.seq, rec)
    full: dict[int, list[int]] = {}
    for seq in sorted(by_seq):
        rec = by_seq[seq]
        if rec.void:
            continue
        base_seq = rec.prompt_base_seq
        if base_seq is None:
            prompt = list(rec.prompt_ids)
        elif base_seq in full:
            base = full[base_seq] + list(by_seq[base_seq].output_ids)
            prompt = base[: rec.prompt_base_len] + list(rec.prompt_ids)
        elif missing is None:
            raise KeyError(base_seq)
        else:
            missing.append(seq)
            continue
        full[seq] = prompt
    return full


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading ids ``a`` and ``b`` share. Compared by slices, in C: a prompt
    that extends the previous call's 20k tokens is one comparison, a rewritten one a
    block at a time (an id at a time in Python was ~1 ms per 20k)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    at = 0
    while at + _PREFIX_BLOCK <= n and a[at : at + _PREFIX_BLOCK] == b[at : at + _PREFIX_BLOCK]:
        at += _PREFIX_BLOCK
    while a[at] == b[at]:  # a difference is within this block
        at += 1
    return at


_PREFIX_BLOCK = 512


def delta_encode(
    prompt: list[int], previous: tuple[int, list[int]] | None
) -> tuple[int | None, int, list[int]]:
    """(base_seq, base_len, tail) for ``prompt`` given the previous call's (seq, prompt+output).

    Uses the longest common prefix, so a prompt that rewrites history still shares storage
    with what it kept.
    """
    if previous is None:
        return None, 0, prompt
    seq, prev = previous
    return delta_at(prompt, seq, common_prefix_length(prev, prompt))


def delta_at(prompt: list[int], seq: int, shared: int) -> tuple[int | None, int, list[int]]:
    """``delta_encode`` for a caller that knows how many leading ids ``prompt`` shares
    with call ``seq``'s prompt+output."""
    if shared < 64:  # not worth a reference
        return None, 0, prompt
    return seq, shared, prompt[shared:]
