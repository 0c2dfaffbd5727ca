"""Why a completion starts a new chain, and which chain it branched from.

Reasons:
  first                 the first main-loop chain of the session
  side_call:<tag>       the proxy marked the call (title, router, count_tokens, probe)
  sub_agent             a different first message (system prompt), or a fresh start with
                        the same one while its parent goes on / another chain ran between
  compaction            same first message, history shortened, replacing the chain it
                        came from (that chain is never extended again)
  history_rewritten     same first message, earlier turns changed (not shorter)
  response_retokenized  the prompt extends the tip's prompt, but the tip's sampled output
                        is not in it token for token (chat-mode re-templating drift)
  retry                 the same prompt as the tip's, sent again
  after_abort           continues a chain whose last turn was aborted or errored

The lineage (parent) is the main-loop chain sharing the longest common token prefix with
the new prompt, the most recently active one on ties; None for the first chain.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    if len(call.prompt) > len(tip.prompt) and starts_with(call.prompt, tip.prompt):
        return "response_retokenized"
    if not same_head(call.prompt, parent.first.prompt, eot):
        return "sub_agent"
    if len(call.prompt) < len(tip.prompt):
        return "compaction" if parent is last_main else "sub_agent"
    return "history_rewritten"


def settle(chains: Sequence[Chain]) -> None:
    """A 'compaction' whose parent is extended afterwards ran beside it: a sub-agent."""
    for chain in chains:
        parent = chain.parent
        if chain.reason == "compaction" and parent is not None and parent.tip.seq > chain.first.seq:
            chain.reason = "sub_agent"
