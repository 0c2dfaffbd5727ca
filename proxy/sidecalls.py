"""Recognising calls a harness makes besides its main loop, so builders keep them out of
the main chain. Heuristics over what the CLIs were observed to send (HARNESSES.md)."""

from __future__ import annotations

from proxy.conversation import Conversation, text_of

OPENING_CHARS = 400


def classify(protocol: str, conv: Conversation) -> str | None:
    if conv.sampling.max_tokens is not None and conv.sampling.max_tokens <= 1:
        return "probe"  # quota / reachability checks (Claude Code)
    if conv.response_format and not conv.tools:
        return "router"  # e.g. Gemini CLI's model router: a JSON-schema answer, no tools
    if conv.tools:
        return None
    if _opens_with(("title",), [conv.system, *(text_of(m.content) for m in conv.messages[:1])]):
        return "title"  # e.g. opencode's first call: a title for the session, no tools
    last = conv.messages[-1] if len(conv.messages) > 2 else None
    if last and last.role == "user" and _opens_with(("summar", "compact"), [text_of(last.content)]):
        return "compaction"  # e.g. Codex's auto-compaction: the history, summarised
    return None


def _opens_with(words: tuple[str, ...], texts: list[str | None]) -> bool:
    """A word in how a text opens: a side call says what it wants up front, while a
    main loop's long instructions may mention it anywhere (Codex's: "Title Case")."""
    heads = [t[:OPENING_CHARS].lower() for t in texts if t]
    return any(w in head for w in words for head in heads)
