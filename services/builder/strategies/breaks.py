"""Why a completion starts a new chain, and which chain it branched from.

Reasons:
  first                 the first main-loop chain of the session
  side_call:<tag>       the call was marked (title, router, count_tokens, probe; judge:
                        an evaluator's, recorded after the build, seen only in a rebuild)
  side_call:compaction  the call that wrote the summary a later ``compaction`` chain starts
                        from (its sampled output reappears in that chain's first prompt),
                        whatever the proxy tagged it: Codex's summarization request has no
                        tools, so its own prompt continues nothing
  sub_agent             a different first message (system prompt), or a fresh start with
                        the same one while its parent goes on / another chain ran between
  compaction            same first message, history shortened, replacing the chain it
                        came from (that chain is never extended again)
  history_rewritten     same first message, earlier turns changed (not shorter)
  response_retokenized  the prompt extends the tip's prompt, but the tip's sampled output
                        is not in it token for token (chat-mode re-templating drift)
  reasoning_dropped,    the proxy found the history re-rendered and named why
  history_rerendered,   (schemas.completion.RERENDER_REASONS, the record's drift_reason):
  tool_arguments_...    the model's reasoning left out, an earlier turn rendered
                        otherwise, arguments re-serialized; never ``compaction``, which
                        the shorter prompt of a dropped reasoning would otherwise suggest
  retry                 the same prompt as the tip's, sent again
  after_abort           continues a chain whose last turn was aborted or errored

The lineage (parent) is the main-loop chain sharing the longest common token prefix with
the new prompt, the most recently active one on ties; None for the first chain. Two
sub-agents of one kind (same first message) share the longest prefix with each other, not
with the loop that started them: a sub-agent whose nearest chain is such a sibling gets the
sibling's lineage (Claude Code starting one `general-purpose` agent after another). A
compaction's summarization call descends from the chain it summarized. A side call made
before the main loop's first call (opencode's title, Gemini CLI's router) descends from
the session's first chain.
"""

from __future__ import annotations

from collections.abc import Sequence

from schemas.completion import RERENDER_REASONS, RESPONSE_RETOKENIZED
from services.builder.strategies.base import Call, common_prefix, starts_with
from services.builder.strategies.chains import Chain


def parent_of(call: Call, chains: Sequence[Chain]) -> Chain | None:
    main = [c for c in chains if c.side_call is None]
    if not main:
        return None
    return max(main, key=lambda c: (common_prefix(call.prompt, c.tokens), c.tip.seq))


def head(prompt: list[int], eot: int | None) -> list[int] | None:
    """The first message's tokens (through its end-of-turn), None if unknown."""
    if eot is None or eot not in prompt:
        return None
    return prompt[: prompt.index(eot) + 1]


def same_head(a: list[int], b: list[int], eot: int | None) -> bool:
    ha, hb = head(a, eot), head(b, eot)
    if ha is not None and hb is not None:
        return ha == hb
    # No end-of-turn to split on: "same start" means sharing most of the shorter prompt.
    return 2 * common_prefix(a, b) >= min(len(a), len(b))


def classify(call: Call, parent: Chain | None, last_main: Chain | None, eot: int | None) -> str:
    if call.rec.side_call:
        return f"side_call:{call.rec.side_call}"
    if parent is None:
        return "first"
    tip = parent.tip
    if tip.cut and starts_with(call.prompt, tip.prompt):
        return "after_abort"
    if call.prompt == tip.prompt:
        return "retry"
    cause = call.rec.drift_reason
    if cause in RERENDER_REASONS:
        return cause  # the proxy found the call it continues, and why its history differs
    if len(call.prompt) > len(tip.prompt) and starts_with(call.prompt, tip.prompt):
        return RESPONSE_RETOKENIZED
    if not same_head(call.prompt, parent.first.prompt, eot):
        return "sub_agent"
    if len(call.prompt) < len(tip.prompt):
        return "compaction" if parent is last_main else "sub_agent"
    return "history_rewritten"


def lineage_of(call: Call, parent: Chain | None, reason: str, eot: int | None) -> Chain | None:
    """The chain a new chain descends from: ``parent``, except that a sub-agent whose
    nearest chain is a sibling sub-agent (same first message) descends from the sibling's
    parent, the loop that started both."""
    if (
        reason == "sub_agent"
        and parent is not None
        and parent.reason == "sub_agent"
        and parent.parent is not None
        and same_head(call.prompt, parent.first.prompt, eot)
    ):
        return parent.parent
    return parent


SUMMARY_MIN_TOKENS = 8  # a shorter output could reappear in a prompt by chance


def carried(output: list[int], prompt: list[int], eot: int | None) -> bool:
    """``output`` (without its end-of-turn and its first and last token, which the next
    template may merge with what surrounds them) appears in ``prompt`` as it was sampled."""
    core = output[:-1] if eot is not None and output[-1:] == [eot] else output
    core = core[1:-1]
    if len(core) < SUMMARY_MIN_TOKENS:
        return False
    n, first = len(core), core[0]
    return any(prompt[i : i + n] == core for i, t in enumerate(prompt) if t == first)


def settle(chains: Sequence[Chain], eot: int | None = None) -> None:
    """Reasons and lineages that only later calls decide."""
    _compactions_beside_their_parent(chains)
    _summarization_calls(chains, eot)
    _early_side_calls(chains)


def _compactions_beside_their_parent(chains: Sequence[Chain]) -> None:
    """A 'compaction' whose parent is extended afterwards ran beside it: a sub-agent."""
    for chain in chains:
        parent = chain.parent
        if chain.reason == "compaction" and parent is not None and parent.tip.seq > chain.first.seq:
            chain.reason = "sub_agent"


def _summarization_calls(chains: Sequence[Chain], eot: int | None) -> None:
    """A one-call chain between a compaction's parent and the compaction, whose output
    the compacted prompt carries, is the summarization call: ``side_call:compaction``.

    A summarization call nobody tagged opens a chain that looks like a main loop (or a
    sub-agent, its tool-less prompt starting otherwise), so the compaction after it
    looks like a sub-agent: a shorter prompt, with the same first message as a chain
    whose output it carries, is that chain's compaction all the same."""
    for chain in chains:
        parent = chain.parent
        if chain.reason not in ("compaction", "sub_agent") or parent is None:
            continue
        start = chain.first
        for cand in chains:
            if (
                len(cand.calls) == 1
                and cand is not chain
                and parent.tip.seq < cand.first.seq < start.seq
                and cand.reason != "side_call:compaction"
                and carried(cand.first.output, start.prompt, eot)
            ):
                if chain.reason == "sub_agent":
                    if cand.parent is not parent and cand.parent is not None:
                        continue
                    if not _replaces(chain, parent, eot):
                        continue
                    chain.reason = "compaction"
                cand.retag("compaction", parent)


def _replaces(chain: Chain, parent: Chain, eot: int | None) -> bool:
    """``chain`` restarts ``parent``'s conversation shorter: same first message, a
    shorter prompt than the one it replaces."""
    start = chain.first
    return len(start.prompt) < len(parent.tip.prompt) and same_head(
        start.prompt, parent.first.prompt, eot
    )


def _early_side_calls(chains: Sequence[Chain]) -> None:
    """A side call that came before any main-loop chain descends from the first chain."""
    root = next((c for c in chains if c.reason == "first"), None)
    for chain in chains:
        if chain.side_call is not None and chain.parent is None:
            chain.parent = root
