"""Trajectories: what a trainer receives on ``polar.trajectories.<task_id>``."""

from __future__ import annotations

from msgspec import Struct

from schemas.completion import ImageSpan
from schemas.session import Outcome


class VersionSpan(Struct, frozen=True, kw_only=True):
    """Response tokens ``[start, end)`` (indices into ``Trace.response_ids``) were sampled
    by the weights of ``version``."""

    version: str
    start: int
    end: int


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
    trainer rebuilds its inputs from.
    """

    trace_id: str
    chain_id: int = 0
    lineage_id: str | None = None  # the chain this one branched from (sub-agent, compaction)
    break_reason: str | None = None  # why this is not part of the previous chain
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    response_logprobs: list[float | None]
    reward: float | None = None
    messages: list[dict[str, object]] = []
    tools: list[dict[str, object]] = []
    weight_versions: list[str] = []
    version_spans: list[VersionSpan] = []
    completion_seqs: list[int] = []  # the CompletionRecords this trace was built from
    images: list[ImageSpan] = []
    side_call: str | None = None
    trainable: bool = True

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
    completions: int = 0
    chains: int = 0
    tokens: int = 0  # tokens a trainer processes (sum of trace lengths)
    sampled_tokens: int = 0
    merge_ratio: float = 1.0  # per_request tokens / built tokens
    breaks: dict[str, int] = {}  # break reason -> count


class Trajectory(Struct, frozen=True, kw_only=True, omit_defaults=True):
    v: int = 1
    session_id: str
    task_id: str
    attempt: int = 0
    outcome: Outcome
    builder: str
    traces: list[Trace]
    reward: float | None = None
    eval_status: str = "pending"  # pending | ok | error
    eval_reason: str | None = None
    intact: bool = True  # false when a capture is missing or a session was cut mid-call
    stats: BuildStats = BuildStats()
    harness: str | None = None
    harness_version: str | None = None
    protocol: str | None = None
    metadata: dict[str, object] = {}
