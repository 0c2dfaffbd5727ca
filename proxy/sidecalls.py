"""Recognising calls a harness makes besides its main loop, so builders keep them out of
the main chain. Heuristics over what the CLIs were observed to send (HARNESSES.md)."""

from __future__ import annotations

from proxy.conversation import Conversation, text_of


def classify(protocol: str, conv: Conversation) -> str | None:
    if conv.sampling.max_tokens is not None and conv.sampling.max_tokens <= 1:
        return "probe"  # quota / reachability checks (Claude Code)
    if conv.response_format and not conv.tools:
        return "router"  # e.g. Gemini CLI's model router: a JSON-schema answer, no tools
    if not conv.tools and _mentions_title(conv):
        return "title"  # e.g. opencode's first call: a title for the session, no tools
    return None


def _mentions_title(conv: Conversation) -> bool:
    texts = [conv.system, *(text_of(m.content) for m in conv.messages[:1])]
    return any("title" in t.lower() for t in texts if t)
