"""The normalized conversation every wire protocol maps to, and the model's answer.

A ``Conversation`` is what a harness asked for, whatever protocol it spoke: the system
text, the messages (text, images, reasoning, tool calls and results), the tools, the
sampling settings. ``to_openai_messages`` / ``to_openai_tools`` give the common input
format of the backends and the chat template. An ``AssistantTurn`` is what the model
answered; each protocol renders it back in its own shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from msgspec import Struct

Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "tool_calls", "abort"]
ToolKind = Literal["function", "custom", "other"]

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"


class TextPart(Struct, frozen=True, omit_defaults=True, tag="text"):
    text: str


class ImagePart(Struct, frozen=True, omit_defaults=True, tag="image"):
    url: str  # http(s) URL or a data: URL (base64 images become data URLs)


class ReasoningPart(Struct, frozen=True, omit_defaults=True, tag="reasoning"):
    text: str
    signature: str = ""


Part = TextPart | ImagePart | ReasoningPart


class ToolCall(Struct, frozen=True):
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


class Message(Struct, frozen=True, kw_only=True, omit_defaults=True):
    role: Role
    content: list[Part] = []
    tool_calls: list[ToolCall] = []
    tool_call_id: str = ""  # role "tool": the call this result answers
    name: str = ""  # role "tool": the tool's name, where known
    is_error: bool = False  # role "tool": the harness marked the result as an error


class ToolSpec(Struct, frozen=True, kw_only=True, omit_defaults=True):
    name: str
    description: str = ""
    parameters: dict[str, Any] = {}  # JSON schema of the arguments
    kind: ToolKind = "function"  # custom: free-form input, offered as {"input": string}
    namespace: str = ""  # OpenAI Responses namespace the tool came in
    deferred: bool = False  # Anthropic/OpenAI defer_loading
    raw: dict[str, Any] = {}  # custom / other tools: as the harness sent them
    # the harness's order of name / description / parameters, when not TOOL_FIELDS': the
    # template dumps the tool as JSON, and the model was served (and trained) on that order
    field_order: tuple[str, ...] = ()


class ToolChoice(Struct, frozen=True, kw_only=True, omit_defaults=True):
    mode: Literal["auto", "none", "required", "named"] = "auto"
    name: str = ""  # mode "named"


class Sampling(Struct, frozen=True, kw_only=True, omit_defaults=True):
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    stop: list[str] = []
    seed: int | None = None


class Reasoning(Struct, frozen=True, kw_only=True, omit_defaults=True):
    enabled: bool | None = None
    effort: str | None = None
    budget_tokens: int | None = None


class Conversation(Struct, frozen=True, kw_only=True, omit_defaults=True):
    model: str = ""  # the harness's model name: echoed in every reply
    system: str = ""
    messages: list[Message] = []
    tools: list[ToolSpec] = []
    tool_choice: ToolChoice | None = None
    sampling: Sampling = Sampling()
    reasoning: Reasoning | None = None
    response_format: dict[str, Any] | None = None  # OpenAI chat shape (json_schema / json_object)
    # chat-template variables the client named (vLLM's and SGLang's chat_template_kwargs,
    # e.g. {"enable_thinking": false}); they win over what ``reasoning`` maps to
    template_kwargs: dict[str, Any] = {}
    stream: bool = False
    metadata: dict[str, Any] = {}  # protocol extras a renderer or the capture may need

    def to_openai_messages(self) -> list[dict[str, Any]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [openai_message(m) for m in self.messages]

    def to_openai_tools(self) -> list[dict[str, Any]]:
        return [openai_tool(t) for t in self.tools if t.kind != "other"]

    def tool_named(self, name: str) -> ToolSpec | None:
        return next((t for t in self.tools if t.name == name), None)


class Usage(Struct, frozen=True, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class AssistantTurn(Struct, frozen=True, kw_only=True, omit_defaults=True):
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = []
    finish_reason: FinishReason = "stop"
    usage: Usage = Usage()


CUSTOM_TOOL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"input": {"type": "string"}},
    "required": ["input"],
}


def openai_message(m: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": openai_content(m.content)}
    if m.role == "assistant":
        reasoning = "".join(p.text for p in m.content if isinstance(p, ReasoningPart))
        if reasoning:
            out["reasoning_content"] = reasoning
        if m.tool_calls:
            out["tool_calls"] = [openai_tool_call(c) for c in m.tool_calls]
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id
        if m.name:
            out["name"] = m.name
    return out


def openai_content(parts: list[Part]) -> str | list[dict[str, Any]]:
    """Text-only content becomes one string (parts joined by newlines, as vLLM does);
    content with images becomes a list of OpenAI content parts. Reasoning is not content."""
    visible = [p for p in parts if not isinstance(p, ReasoningPart)]
    if all(isinstance(p, TextPart) for p in visible):
        return "\n".join(p.text for p in visible)  # type: ignore[union-attr]
    return [
        {"type": "text", "text": p.text}
        if isinstance(p, TextPart)
        else {"type": "image_url", "image_url": {"url": p.url}}
        for p in visible
    ]


def openai_tool_call(c: ToolCall) -> dict[str, Any]:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


TOOL_FIELDS = ("name", "description", "parameters")  # the order every known harness uses


def field_order(tool: Mapping[str, Any], parameters_key: str = "parameters") -> tuple[str, ...]:
    """The order ``tool`` (as the harness sent it) gives its name, description and
    parameters (under ``parameters_key``: Anthropic's ``input_schema``); () for the usual."""
    names = {"name": "name", "description": "description", parameters_key: "parameters"}
    seen = list(dict.fromkeys(names[k] for k in tool if k in names))
    if seen == [f for f in TOOL_FIELDS if f in seen]:
        return ()  # the usual order of what it has (a missing field is not rendered)
    return tuple(dict.fromkeys([*seen, *TOOL_FIELDS]))


def openai_tool(t: ToolSpec) -> dict[str, Any]:
    """The tool as the template gets it, its fields in the harness's order."""
    values = {
        "name": t.name,
        "description": t.description,
        "parameters": t.parameters or {"type": "object", "properties": {}},
    }
    fn = {f: values[f] for f in t.field_order or TOOL_FIELDS if f != "description" or t.description}
    return {"type": "function", "function": fn}


def text_of(parts: list[Part]) -> str:
    return "\n".join(p.text for p in parts if isinstance(p, TextPart))


def strip_billing_header(text: str) -> str:
    """Drop Claude Code's per-request billing line, which would break prefix reuse."""
    if BILLING_HEADER_PREFIX not in text:
        return text
    lines = text.split("\n")
    return "\n".join(
        line for line in lines if not line.lstrip().startswith(BILLING_HEADER_PREFIX)
    ).strip("\n")


def join_system(texts: list[str]) -> str:
    """System blocks in order, billing header removed, empty blocks dropped."""
    kept = [t for t in (strip_billing_header(x) for x in texts) if t]
    return "\n\n".join(kept)


def fill_tool_names(messages: list[Message]) -> list[Message]:
    """Give tool results the name of the call they answer (templates often want it)."""
    names = {c.id: c.name for m in messages for c in m.tool_calls}
    out = []
    for m in messages:
        if m.role == "tool" and not m.name and m.tool_call_id in names:
            m = Message(
                role="tool",
                content=m.content,
                tool_call_id=m.tool_call_id,
                name=names[m.tool_call_id],
                is_error=m.is_error,
            )
        out.append(m)
    return out
