"""Trajectories: what a trainer receives on ``polar.trajectories.<task_id>``."""

from __future__ import annotations

from msgspec import Struct

from schemas.completion import ImageSpan, ToolParse
from schemas.routing import TraceRouting
from schemas.session import Outcome


class VersionSpan(Struct, frozen=True, kw_only=True):
    """Response tokens ``[start, end)`` (indices into ``Trace.response_ids``) were sampled
    by the weights of ``version``."""

    version: str  # the weight version that sampled them
    start: int  # the first response index of the span
    end: int  # one past its last


class ToolFailure(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A tool call of a trace's turns that did not become a valid call: its record's
    ``ToolParseFailure``, placed in the trace."""

    seq: int  # the CompletionRecord whose output holds it
    kind: str  # malformed | unknown_tool | invalid_arguments
    detail: str = ""  # what was wrong, in the parser's words
    start: int = -1  # response_ids indices [start, end); -1: the call as a whole
    end: int = -1  # one past the span's last index; -1: the call as a whole


class TraceToolParse(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Tool-call parse health of a trace's turns (their records' ``tool_parse``)."""

    family: str = ""  # the model family whose parser read them
    turns: int = 0  # model calls that offered tools: their output's tool markup was read
    checked: int = 0  # tool calls those outputs wrote, parsed or not
    failures: list[ToolFailure] = []  # the ones that did not parse or check, in order

    @property
    def failed(self) -> int:
        return len(self.failures)

    @property
    def parsed(self) -> int:
        return max(self.checked - self.failed, 0)


MALFORMED = "malformed"  # the one failure kind whose call is not among the parsed ``calls``


def checked_calls(parse: ToolParse) -> int:
    """Tool calls an output wrote, parsed or not: each parsed call (a call of a tool not
    offered, or with arguments against its schema, parses, then fails the check and stays
    in ``calls``) and each piece of markup that did not parse (``malformed``)."""
    return parse.calls + sum(1 for f in parse.failures if f.kind == MALFORMED)


class Trace(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One trainable sequence: prompt_ids + response_ids, mask and logprobs over the response.

    ``loss_mask`` is 1 exactly on tokens the model sampled; interstitial tokens (tool
    results, template glue) are 0 and their logprob is ``None``. ``version_spans`` cover
    every sampled token whose engine reported a weight version, in order, never a masked
    one; ``weight_versions`` lists the distinct versions (kept for older readers).
    ``messages`` is the whole conversation as OpenAI-shaped messages, the last sampled
    assistant turn included, and ``tools`` the tool specs it was sampled with. ``images``
    are the images the model read, each by digest at its token span in ``prompt_ids +
    response_ids`` (their bytes: ``subjects.image_object(digest)``): what a multimodal
    trainer rebuilds its inputs from. ``tool_parse`` says whether the tool calls of its
    turns parsed, each failure at its span of ``response_ids`` (docs/training.md).
    ``routing`` says which experts an MoE engine routed each position to (R3).
    """

    trace_id: str  # "<session_id>/<chain_id>"
    chain_id: int = 0  # the chain's number in its session (a chain: calls each extending the last)
    lineage_id: str | None = None  # the chain this one branched from (sub-agent, compaction)
    break_reason: str | None = None  # why this is not part of the previous chain
    prompt_ids: list[int]  # the chain's first prompt, token ids
    # every token after the prompt: sampled ones and those between (tool results, template glue)
    response_ids: list[int]
    loss_mask: list[int]  # per response token: 1 where the model sampled it, else 0
    # per response token: the engine's logprob of a sampled one, else None
    response_logprobs: list[float | None]
    reward: float | None = None  # this trace's own reward, when the evaluator gives one per trace
    # the conversation as OpenAI-shaped messages, the last sampled turn included
    messages: list[dict[str, object]] = []
    tools: list[dict[str, object]] = []  # the tool specs offered with it (OpenAI shape)
    # the distinct weight versions that sampled it (version_spans says where)
    weight_versions: list[str] = []
    # which weight version sampled which response tokens, in order
    version_spans: list[VersionSpan] = []
    completion_seqs: list[int] = []  # the CompletionRecords this trace was built from
    # the images the model read, each at its token span of prompt_ids + response_ids
    images: list[ImageSpan] = []
    # a call outside the main loop (title, router, probe, judge); None: the main loop
    side_call: str | None = None
    trainable: bool = True  # false: a trainer skips it (a side call, a trace cut off mid-call)
    tool_parse: TraceToolParse | None = None  # None: none of its calls offered tools
    # MoE expert routing per position of prompt_ids + response_ids (schemas/routing.py;
    # routing_array reads it): None when the engine returned none
    routing: TraceRouting | None = None

    def token_versions(self) -> list[str | None]:
        """The weight version of each response token; None where no version sampled it
        (masked tokens, or an engine that reports none)."""
        return token_versions(self.version_spans, len(self.response_ids))


def token_versions(spans: list[VersionSpan], n: int) -> list[str | None]:
    out: list[str | None] = [None] * n
    for span in spans:
        for i in range(max(span.start, 0), min(span.end, n)):
            out[i] = span.version
    return out


class BuildStats(Struct, frozen=True, kw_only=True, omit_defaults=True):
    completions: int = 0  # model calls read
    chains: int = 0  # traces built
    tokens: int = 0  # tokens a trainer processes (sum of trace lengths)
    sampled_tokens: int = 0  # tokens the model sampled (loss mask 1)
    merge_ratio: float = 1.0  # per_request tokens / built tokens
    breaks: dict[str, int] = {}  # break reason -> count
    # tool-call parse health of the calls built (their records' ``tool_parse``): model
    # calls that offered tools, the tool calls they wrote, those that failed by kind
    tool_turns: int = 0
    tool_calls_checked: int = 0  # tool calls written on calls that offered tools, parsed or not
    # those that failed, by kind (malformed | unknown_tool | invalid_arguments)
    tool_calls_failed: dict[str, int] = {}


class Grade(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One evaluator's verdict on a session (``polar regrade``): a re-graded trajectory
    carries the session's own grade first, then the re-grade's."""

    evaluator: str  # the evaluator's name (or "module:Class")
    config_digest: str = ""  # sha256 of its config, short: two configs of one name differ
    reward: float | None = None  # None: the evaluation failed (``reason`` says why)
    status: str = "ok"  # ok | error
    reason: str | None = None  # why this reward, in the evaluator's words (or why it failed)
    regrade_id: str | None = None  # None: the session's own evaluation
    via: str = "session"  # session | artifacts | replay (which replay: ``replay_session``)
    replay_session: str | None = None  # the replay graded, when ``via`` is replay


class Trajectory(Struct, frozen=True, kw_only=True, omit_defaults=True):
    v: int = 1  # the shape's version
    session_id: str  # the session it records
    task_id: str  # the session's task
    attempt: int = 0  # the session attempt it was built from (0, then one more per retry)
    outcome: Outcome  # how the harness run ended
    builder: str  # the builder that made the traces (prefix_merging, per_request, ...)
    traces: list[Trace]  # the trainable sequences, in the order their chains began
    # the session's reward; None: not evaluated yet, or the evaluation failed
    reward: float | None = None
    eval_status: str = "pending"  # pending | ok | error
    eval_reason: str | None = None  # why this reward, in the evaluator's words
    intact: bool = True  # false when a capture is missing or a session was cut mid-call
    stats: BuildStats = BuildStats()  # what the build counted
    harness: str | None = None  # the harness that ran (its preset's name)
    harness_version: str | None = None  # its version, when the harness reports one
    # the model API the harness spoke (openai_chat, anthropic_messages, ...)
    protocol: str | None = None
    # the build's notes (reward policy, record count, integrity problems)
    metadata: dict[str, object] = {}
    # a re-graded trajectory (``polar regrade``): every grade, the session's own first;
    # ``reward`` is the last one's. Empty on what the session's evaluation delivered.
    grades: list[Grade] = []
