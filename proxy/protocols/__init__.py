"""The wire protocols the proxy speaks; the app mounts every route of every entry."""

from proxy.protocols import anthropic_messages, gemini, models, openai_chat, openai_responses
from proxy.protocols.base import Endpoint, ProtocolSpec, ReplyIds, Route

PROTOCOLS: tuple[ProtocolSpec, ...] = (
    openai_chat.PROTOCOL,
    openai_responses.PROTOCOL,
    anthropic_messages.PROTOCOL,
    gemini.PROTOCOL,
    models.PROTOCOL,
)

__all__ = ["PROTOCOLS", "Endpoint", "ProtocolSpec", "ReplyIds", "Route"]
