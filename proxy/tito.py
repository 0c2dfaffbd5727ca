"""Token in, token out: prompts that extend the previous call token for token.

For each call of a session the proxy keeps a ``TurnState``: the request's messages, the
assistant message it answered with, and the exact prompt and output ids. A new request
that continues a known state (same messages, then that assistant answer, then anything
new) gets the prompt ``state.prompt + state.output + glue`` where ``glue`` is the
template's rendering of what follows the answer. The ids the model sampled are reused
verbatim, so no re-templating (dropped thinking, re-serialized tool arguments, lost
separators) can make a prompt drift. A request that continues no state is rendered in
full, and ``classify_break`` says why it did not extend.

Pure functions over a ``ChatTokenizer``; storage of states is the caller's business.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from proxy.routing import RoutingState
from schemas.completion import (
    HISTORY_RERENDERED,
    REASONING_DROPPED,
    RESPONSE_RETOKENIZED,
    ImageSpan,
    common_prefix_length,
)
from services.common.tokenization import ChatTokenizer, TemplateRenderError
from services.common.tokenization.images import image_urls

MAX_STATES = 8  # per session: main loop, sub-agents, side calls (each branch keeps 2)


class TurnState(msgspec.Struct, kw_only=True):
    seq: int  # set after decoding: the store keeps it beside the encoded state
    messages: list[dict[str, Any]]
    reply: dict[str, Any]  # the assistant message this call answered with
    tools_key: str
    prompt: bytes  # uint32 ids, packed (prompts may be 200k tokens long)
    output: bytes
    base: int | None = None  # the seq of the state this call continued, if any
    routing: RoutingState | None = None  # MoE: what its record's routing holds (routing.py)

    @property
    def prompt_ids(self) -> list[int]:
        return unpack(self.prompt)

    @property
    def output_ids(self) -> list[int]:
        return unpack(self.output)

    def sampled_ids(self) -> list[int]:
        """The prompt, then the output: what a call continuing this one starts with."""
        return unpack(self.prompt + self.output)

    @property
    def system(self) -> str:
        return system_text(self.messages)


ID_BYTES = array("I").itemsize  # a packed id's size


def pack(ids: list[int]) -> bytes:
    return array("I", ids).tobytes()


def unpack(data: bytes) -> list[int]:
    a = array("I")
    a.frombytes(data)
    return a.tolist()


def tools_key(tools: list[dict[str, Any]] | None, kwargs: dict[str, Any] | None = None) -> str:
    """What a continued call must share with the call it continues besides its history:
    the tools, and the chat-template variables (``<tools hash>:<variables hash>``)."""
    key = hashlib.sha1(orjson.dumps(tools or [], option=orjson.OPT_SORT_KEYS)).hexdigest()
    if not kwargs:
        return key
    variables = orjson.dumps(kwargs, option=orjson.OPT_SORT_KEYS, default=str)
    return f"{key}:{hashlib.sha1(variables).hexdigest()}"


def _tools_part(key: str) -> str:
    return key.partition(":")[0]


def system_text(messages: list[dict[str, Any]]) -> str:
    return "".join(
        _text(m.get("content")) for m in messages if m.get("role") in ("system", "developer")
    )


@dataclass(frozen=True)
class PromptPlan:
    prompt_ids: list[int]
    base: TurnState | None  # the state it extends (token mode) or best matches
    extends: bool | None  # None on a session's first call
    drift_reason: str | None
    images: tuple[ImageSpan, ...] = ()  # where the prompt's images sit in it
    # What planning found out already, so the call's record and state do not again (a
    # 20k-token prompt's ids take ~0.2 ms to unpack, ~0.08 ms to pack): how many leading
    # ids the prompt shares with ``base.sampled_ids()``, and the prompt packed.
    shared: int | None = None
    packed: bytes | None = None

    def packed_prompt(self) -> bytes:
        return self.packed if self.packed is not None else pack(self.prompt_ids)


# -- comparing messages ---------------------------------------------------------------
def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)


def _args(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments.strip()
    return arguments


def _calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        out.append((fn.get("name"), _args(fn.get("arguments"))))
    return out


def same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal as the model sees them; ids and echoed-back reasoning do not matter."""
    if a.get("role") != b.get("role"):
        return False
    if _text(a.get("content")).strip() != _text(b.get("content")).strip():
        return False
    # images are tokens alike whatever they show: an image changed is a message changed
    return _calls(a) == _calls(b) and image_urls([a]) == image_urls([b])


def _continues(messages: list[dict[str, Any]], state: TurnState) -> bool:
    """``messages`` are ``state``'s history, its answer, then more (``state`` has a
    shorter history under the same tools: ``best_continued`` picks only those)."""
    n = len(state.messages)
    if not same_message(messages[n], state.reply):
        return False
    # A harness echoes its history as it sent it, so the history is most often equal as
    # it stands (one comparison in C); else message by message, as the model sees them.
    history = messages[:n]
    return history == state.messages or all(
        same_message(x, y) for x, y in zip(history, state.messages, strict=True)
    )


def best_continued(
    messages: list[dict[str, Any]], key: str, states: list[TurnState]
) -> TurnState | None:
    """The state with the longest history that ``messages`` continues (the newest of
    those as long). Tried longest first: in a conversation that only grows, the newest
    state is continued and the others are not looked at (each is a whole-history
    comparison: a session keeps up to ``MAX_STATES``)."""
    # only a shorter history under the same tools can be continued: a re-sent or
    # unrelated request meets no sort and no comparison when a session holds many states
    n = len(messages)
    candidates = [s for s in states if len(s.messages) < n and s.tools_key == key]
    if len(candidates) > 1:
        candidates.sort(key=_longest_newest, reverse=True)
    for state in candidates:
        if _continues(messages, state):
            return state
    return None


def _longest_newest(state: TurnState) -> tuple[int, int]:
    return len(state.messages), state.seq


def classify_break(messages: list[dict[str, Any]], key: str, states: list[TurnState]) -> str:
    """Why a request continues none of the session's states."""
    last = max(states, key=_seq)
    if messages == last.messages and key == last.tools_key:  # the same request again
        return "history_truncated"
    if system_text(messages) != last.system:
        return "system_prompt_changed"  # a sub-agent, or a side call with its own prompt
    if _tools_part(key) != _tools_part(last.tools_key):
        return "tools_changed"
    if key != last.tools_key:
        return "template_kwargs_changed"  # e.g. thinking turned off mid-conversation
    first_user = next((m for m in messages if m.get("role") == "user"), None)
    last_user = next((m for m in last.messages if m.get("role") == "user"), None)
    if first_user and last_user and not same_message(first_user, last_user):
        return "new_conversation"
    n = len(last.messages)
    if len(messages) <= n:
        return "history_truncated"  # compaction, or a retry of an earlier turn
    if not same_message(messages[n], last.reply):
        return "assistant_turn_rewritten"
    return "history_rewritten"


def _seq(state: TurnState) -> int:
    return state.seq


# -- building prompts -------------------------------------------------------------------
KEEP_SAMPLED = "keep_sampled"  # the history as the model sampled it (the default)
RERENDER = "rerender"  # the history as the template renders it: a new chain, its cause named
HISTORY_POLICIES = (KEEP_SAMPLED, RERENDER)


class HistoryRerendered(TemplateRenderError):
    """The template renders the continued history otherwise (``cause``: a drift reason)."""

    def __init__(self, cause: str) -> None:
        super().__init__(f"the chat template re-renders earlier turns ({cause})")
        self.cause = cause


def head_text(tok: ChatTokenizer, state: TurnState, tools, kwargs: Kwargs = None) -> str:
    """The template's text of ``state``'s history and answer: what a call continuing it
    starts with (``tools`` and template ``kwargs`` as in that call: continuing requires
    the same)."""
    return tok.render(
        state.messages + [state.reply], tools, add_generation_prompt=False, **(kwargs or {})
    )


HeadTexts = Callable[[TurnState], str | None]  # head_text rendered earlier, if at hand
Kwargs = dict[str, Any] | None  # chat-template variables of a request (enable_thinking, ...)


def _glue_text(
    tok: ChatTokenizer,
    state: TurnState,
    messages,
    tools,
    heads: HeadTexts | None = None,
    kwargs: Kwargs = None,
    policy: str = KEEP_SAMPLED,
) -> str:
    """Template text between the end of ``state``'s sampled output and the new prompt's end."""
    # Render the history as this proxy produced it (the harness's echo of it may differ
    # in reasoning, ids or argument spacing): only the new tail comes from the request.
    head = state.messages + [state.reply]
    tail = messages[len(head) :]
    before = heads(state) if heads is not None else None
    if before is None:
        before = head_text(tok, state, tools, kwargs)
    full = tok.render(head + tail, tools, add_generation_prompt=True, **(kwargs or {}))
    closed = state.output and tok.is_end_of_turn(state.output_ids[-1])
    if full.startswith(before):  # an append-only template: the new text is what follows
        eot = _eot_text(tok, before)
        after_eot = before[before.rindex(eot) + len(eot) :]
        return (after_eot if closed else eot + after_eot) + full[len(before) :]
    # The template renders earlier turns otherwise once more follows (Qwen3 drops the
    # reasoning before the last user turn, gpt-oss an answer's analysis and its <|return|>).
    if policy == RERENDER:
        raise HistoryRerendered(rerender_cause(head, full))
    end, after_end = _tail_after_turn(tok, head, tail, tools, full, kwargs)
    return after_end if closed else end + after_end


MARK = "\ue000polar-tail\ue001"  # private-use characters: no conversation holds them


def _tail_after_turn(
    tok: ChatTokenizer, head, tail, tools, full: str, kwargs: Kwargs
) -> tuple[str, str]:
    """(the turn end, the text after it) of ``head``'s last assistant turn in ``full``,
    the template's rendering of ``head + tail``: the text the template gives the new
    messages and the generation prompt, whatever it does to the history before them.

    The new messages' first text is found by rendering them with a mark at its start;
    the turn end just before the mark, and how many turn ends follow it, locate the same
    place in ``full`` counted from its end (the mark may block a trim, so ``full`` itself
    is what is returned). Raises TemplateRenderError when the two renders disagree."""
    first = dict(tail[0])
    content = first.get("content")
    if isinstance(content, list):
        first["content"] = [{"type": "text", "text": MARK}, *content]
    else:
        first["content"] = MARK + (content or "")
    marked = tok.render(
        head + [first, *tail[1:]], tools, add_generation_prompt=True, **(kwargs or {})
    )
    at = marked.find(MARK)
    if at < 0 or marked.count(MARK) != 1:
        raise TemplateRenderError("the chat template does not render the new messages' text")
    ends = tok.turn_ends
    pos, end = max((marked.rfind(e, 0, at), e) for e in ends)
    if pos < 0:
        raise TemplateRenderError("no end-of-turn text before the new messages")
    lead = marked[pos + len(end) : at]  # the template's text before the first new content
    later = sum(marked.count(e, at) for e in ends)  # turn ends the new messages bring
    cut = len(full)
    for _ in range(later + 1):
        cut, found = max((full.rfind(e, 0, cut), e) for e in ends)
        if cut < 0:
            raise TemplateRenderError("the chat template re-renders earlier turns")
    after = full[cut + len(found) :]
    if found != end or not after.startswith(lead):
        raise TemplateRenderError("the chat template re-renders earlier turns")
    for message in tail:  # a template that moves new text up front (a late system
        probe = _PLAIN_RUN.search(_text(message.get("content")))  # message) loses it here
        if probe is not None and probe.group() not in after:
            raise TemplateRenderError("the chat template moves new messages' text earlier")
    return end, after


# text no template escapes (tojson, XML), long enough to mean something
_PLAIN_RUN = re.compile(r"[A-Za-z0-9 ]{3,32}")


def rerender_cause(head: list[dict[str, Any]], full: str) -> str:
    """Why the template's rendering of a continued history is not the sampled one: the
    model's reasoning left out (Qwen3 before the last user turn, gpt-oss's analysis), or
    some other change of an earlier turn."""
    for message in head:
        reasoning = message.get("reasoning_content") if message.get("role") == "assistant" else None
        if reasoning and reasoning.strip() and reasoning.strip() not in full:
            return REASONING_DROPPED
    return HISTORY_RERENDERED


def _eot_text(tok: ChatTokenizer, rendered: str) -> str:
    """The end-of-turn token text as the template writes it (the last one in ``rendered``)."""
    found = [(rendered.rindex(t), t) for t in tok.turn_ends if t and t in rendered]
    if not found:
        raise TemplateRenderError("no end-of-turn token in the rendered assistant turn")
    return max(found)[1]


def plan_token_prompt(
    tok: ChatTokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    states: list[TurnState],
    key: str | None = None,  # tools_key(tools, kwargs), when the caller has it
    heads: HeadTexts | None = None,  # head texts rendered ahead of time (an exact cache)
    rendered: list[int] | None = None,  # tok.render_ids(messages, tools), if done ahead
    kwargs: Kwargs = None,  # the request's chat-template variables
    policy: str = KEEP_SAMPLED,  # what a template that re-renders the history gets
) -> PromptPlan:
    key = key or tools_key(tools, kwargs)
    base = best_continued(messages, key, states)
    reason = RESPONSE_RETOKENIZED
    if base is not None:
        try:
            glue = tok.encode(_glue_text(tok, base, messages, tools, heads, kwargs, policy))
            base_ids = base.sampled_ids()
            packed = base.prompt + base.output + pack(glue)
            ids = base_ids + glue
            return PromptPlan(ids, base, True, None, shared=len(base_ids), packed=packed)
        except HistoryRerendered as exc:  # the policy: the template's rendering, below
            reason = exc.cause
        except TemplateRenderError:  # the new text could not be told apart: whole, below
            reason = HISTORY_RERENDERED
    if rendered is None:
        rendered = tok.render_ids(messages, tools, **(kwargs or {}))
    prompt = rendered
    if base is not None:
        return PromptPlan(prompt, base, False, reason)
    if not states:
        return PromptPlan(prompt, None, None, None)
    return PromptPlan(prompt, None, False, classify_break(messages, key, states))


def judge_chat_prompt(
    prompt_ids: list[int],
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    states: list[TurnState],
    key: str | None = None,  # tools_key(tools), when the caller has it
    decode: Callable[[list[int]], str] | None = None,  # the model's, to name a cause
) -> PromptPlan:
    """Chat mode: the engine templated the prompt; did it extend a previous call?"""
    if not states:
        return PromptPlan(prompt_ids, None, None, None)
    key = key or tools_key(tools)
    base = best_continued(messages, key, states)
    if base is None:
        return PromptPlan(prompt_ids, None, False, classify_break(messages, key, states))
    # compared packed: the state's ids need no unpacking, and the new state keeps these
    prefix, packed = base.prompt + base.output, _packed(prompt_ids)
    n = len(prefix) // ID_BYTES
    if len(prompt_ids) > n and (
        packed.startswith(prefix) if packed is not None else prompt_ids[:n] == base.sampled_ids()
    ):
        return PromptPlan(prompt_ids, base, True, None, shared=n, packed=packed)
    at = common_prefix_length(prompt_ids, base.sampled_ids())
    reason = rerender_reason(messages, base, at, prompt_ids, decode)
    return PromptPlan(prompt_ids, base, False, reason, shared=at, packed=packed)


def _packed(ids: list[int]) -> bytes | None:
    """``pack(ids)``, or None for ids no vocabulary has (an engine's bug: compared as
    lists, and the call fails where it did before, when its state is packed)."""
    try:
        return pack(ids)
    except (OverflowError, TypeError):
        return None


def _raw_args(message: dict[str, Any]) -> list[str]:
    return [str(c.get("function", c).get("arguments")) for c in message.get("tool_calls") or []]


def rerender_reason(
    messages: list[dict[str, Any]],
    base: TurnState,
    at: int,
    prompt_ids: list[int] = (),
    decode: Callable[[list[int]], str] | None = None,
) -> str:
    """Chat mode: why the engine's templating of a continued history is not the sampled
    prefix. The first differing token (``at``, how many leading ids the prompt shares
    with ``base``'s) says where; the echoed answer says how."""
    prompt_len = len(base.prompt) // ID_BYTES
    if at < prompt_len:  # within the base's prompt
        return HISTORY_RERENDERED  # an earlier turn renders differently this time
    echoed, reply = messages[len(base.messages)], base.reply
    reasoning = (reply.get("reasoning_content") or "").strip()
    if reasoning and (
        not echoed.get("reasoning_content")
        or (decode is not None and reasoning not in decode(prompt_ids[prompt_len:]))
    ):
        # the client did not send the model's thinking back, or the template left it
        # out (Qwen3 before the last user turn) and kept the answer after it
        return REASONING_DROPPED
    if _raw_args(echoed) != _raw_args(reply):
        return "tool_arguments_reserialized"  # same JSON, other spacing or key order
    if _text(echoed.get("content")) != _text(reply.get("content")):
        return "assistant_text_changed"  # e.g. stripped whitespace
    return RESPONSE_RETOKENIZED  # the template renders the answer otherwise
