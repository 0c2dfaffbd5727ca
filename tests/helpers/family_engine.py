"""A fake SGLang engine over a model family's real vocabulary, for end-to-end tests.

``FamilyEngine(model_dir)`` loads the directory with ``transformers.AutoTokenizer`` (the
real vocabulary and official chat template, independent of Polar's own tokenizer code)
and serves, over real HTTP on 127.0.0.1, the SGLang surface the proxy's client speaks
(``proxy/backends/sglang_wire.py``): ``/model_info``, ``/server_info``, ``/health``,
``/generate`` (ids in, ids out) and ``/v1/chat/completions`` with the ids flags of
SGLang >= 0.5.13. It runs an aiohttp app on a loop of its own, in a thread.

It samples nothing. Each answer is scripted from the decoded prompt and written in the
family's own output format (``WRITERS``: Hermes JSON or XML tool calls in ``<tool_call>``
with ``<think>`` reasoning, Llama's JSON, harmony channels, DeepSeek's full-width
markup, Mistral's ``[TOOL_CALLS]``), then tokenized with the real vocabulary and closed
with the family's end token. The harness steers the script through text the template
keeps in the prompt (``Script``):

* ``[[plan: tool parallel malformed final]]`` in the task: the answer kind of each
  model turn (``KINDS``; past the plan's end, ``final``);
* ``[[reply K]]`` in every tool result or user message that answers model turn K: the
  next turn is the highest K + 1 (0 before any reply);
* ``[[fake: OPTION]]`` anywhere: ``empty-reasoning``, ``unicode`` (non-ASCII arguments
  on every call), ``eom`` (Llama: a tool call ends with ``<|eom_id|>``).

That is the default script (``Directives``). ``PolicyScript`` instead answers as the
embedded engine's scripted policy does (``services/engine/policy.py``, e.g.
``tests/fixtures/policies/harness_*.yaml`` for the real CLIs): the conversation is read
back from the prompt (ChatML or harmony), the policy's rules choose the turn (its default
for a call no rule matches: a CLI's side calls), and the turn is written in the family's
format, with reasoning.

Logprobs are deterministic (a hash of position and id, in [-3, 0)); ``max_new_tokens`` /
``max_tokens`` cut a longer answer, which then finishes with ``length``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from infra import localservers
from services.engine.policy import Policy, choose_turn, messages_from_prompt

KINDS = ("tool", "parallel", "malformed", "final")
TOOL = "exec_command"
WEIGHT_VERSION = "fake-1"
SGLANG_VERSION = "0.5.13"

_PLAN = re.compile(r"\[\[plan: ([a-z ]+)\]\]")
_REPLY = re.compile(r"\[\[reply (\d+)\]\]")
_OPTION = re.compile(r"\[\[fake: ([a-z-]+)\]\]")


# -- the script (pure) ------------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Answer:
    """One model turn: its reasoning, then tool calls (``tool``, ``parallel``), a call
    whose markup does not parse (``malformed``), or a final text."""

    turn: int
    kind: str
    reasoning: str
    calls: tuple[Call, ...] = ()
    text: str = ""


def plan_directive(kinds: list[str]) -> str:
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown answer kinds {unknown}; known: {', '.join(KINDS)}")
    return f"[[plan: {' '.join(kinds)}]]"


def reply_directive(turn: int) -> str:
    return f"[[reply {turn}]]"


def option_directive(option: str) -> str:
    return f"[[fake: {option}]]"


def script_answer(turn: int, kind: str, options: frozenset[str] = frozenset()) -> Answer:
    """What the model answers on ``turn`` (0-based) when the plan says ``kind``."""
    reasoning = "" if "empty-reasoning" in options else reasoning_of(turn)
    if kind == "final":
        text = f"All checks pass after {turn} tool turns: the fixture was missing."
        return Answer(turn, kind, reasoning, text=text)
    calls = [Call(TOOL, arguments_of(turn, 0, options))]
    if kind == "parallel":
        calls.append(
            Call(TOOL, {"cmd": f"git log -1 --format=%s  # turn {turn}", "timeout_ms": 5000})
        )
    return Answer(turn, kind, reasoning, calls=tuple(calls))


def reasoning_of(turn: int) -> str:
    return f"Turn {turn}: the tests fail → look at step {turn} before changing anything."


def arguments_of(turn: int, index: int, options: frozenset[str]) -> dict[str, Any]:
    if "unicode" in options:
        return {
            "cmd": f"grep -rn 'naïve café ✓ 日本語 🚀' src/  # turn {turn}",
            "workdir": "/repo/données",
        }
    return {"cmd": f"pytest -x tests/step_{turn}_{index}.py"}


@dataclass(frozen=True)
class Script:
    """What the harness asked for, read from a decoded prompt."""

    turn: int
    kind: str
    options: frozenset[str]

    @classmethod
    def read(cls, prompt: str) -> Script:
        plans = _PLAN.findall(prompt)
        kinds = plans[0].split() if plans else ["tool", "tool", "tool", "final"]
        replies = [int(k) for k in _REPLY.findall(prompt)]
        turn = max(replies) + 1 if replies else 0
        kind = kinds[turn] if turn < len(kinds) else "final"
        return cls(turn, kind, frozenset(_OPTION.findall(prompt)))

    def answer(self) -> Answer:
        return script_answer(self.turn, self.kind, self.options)


class Directives:
    """The default script: the prompt's ``[[plan]]``, ``[[reply K]]`` and ``[[fake]]``."""

    def read(self, prompt: str, writer: Writer) -> tuple[Answer, frozenset[str]]:
        script = Script.read(prompt)
        return script.answer(), script.options


POLICY_REASONING = "The script has a turn for this message: follow it."


@dataclass(frozen=True)
class PolicyScript:
    """Answers as the embedded engine's scripted ``policy`` chooses them: the first rule
    whose regex is found in the last message of the conversation (read back from the
    prompt), else the positional turns, else the policy's default. Each turn is written
    with its reasoning (``POLICY_REASONING`` where it has none), then its text and calls."""

    policy: Policy

    def read(self, prompt: str, writer: Writer) -> tuple[Answer, frozenset[str]]:
        messages = writer.messages(prompt)
        turn = choose_turn(self.policy, messages)
        calls = tuple(Call(c.name, dict(c.arguments)) for c in turn.tool_calls)
        reasoning = POLICY_REASONING if turn.reasoning is None else turn.reasoning
        index = sum(1 for m in messages if m.get("role") == "assistant")
        kind = "tool" if calls else "final"
        return Answer(index, kind, reasoning, calls, turn.text), frozenset()


# -- the families' output formats -------------------------------------------------------
def _json(value: Any, compact: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":") if compact else None)


def _json_text(body: str) -> str:
    """A JSON string's text (harmony writes tool results as ``tojson``), else ``body``."""
    try:
        value = json.loads(body)
    except ValueError:
        return body
    return value if isinstance(value, str) else body


class Writer:
    """How a family writes a turn: ``reasoning + body + end``."""

    reasons = True  # the family has a reasoning block

    def __init__(self, template: str) -> None:
        self.template = template

    def reasoning(self, text: str, prompt: str) -> str:
        """The reasoning block, given the prompt it continues (which may have opened it,
        or closed it: thinking turned off)."""
        if prompt.endswith("</think>\n\n"):
            return ""
        if prompt.endswith("<think>\n"):
            return f"{text}\n</think>\n\n"
        return f"<think>\n{text}\n</think>\n\n"

    def preamble(self, text: str) -> str:
        """What the turn writes between its reasoning and its calls: ``text`` where the
        format carries text beside calls, else nothing."""
        return ""

    def messages(self, prompt: str) -> list[dict[str, Any]]:
        """The conversation of ``prompt`` (role and text of each message, without the
        generation prompt), for a ``PolicyScript``."""
        raise NotImplementedError(f"{type(self).__name__}: no policy script for this format")

    def calls(self, calls: tuple[Call, ...], ids: list[str]) -> str:
        raise NotImplementedError

    def malformed(self, call: Call) -> str:
        raise NotImplementedError

    def final(self, text: str) -> str:
        return text

    def end(self, answer: Answer, options: frozenset[str]) -> str:
        raise NotImplementedError


class Hermes(Writer):
    """Qwen3: JSON in ``<tool_call>`` blocks."""

    def preamble(self, text):  # as the template writes content before a call
        return f"{text}\n\n" if text else ""

    def messages(self, prompt):  # ChatML, read as the embedded engine reads it
        return messages_from_prompt(prompt[: prompt.rfind("<|im_start|>assistant")])

    def calls(self, calls, ids):
        blocks = (_json({"name": c.name, "arguments": c.arguments}) for c in calls)
        return "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)

    def malformed(self, call):
        return f'<tool_call>\n{{"name": "{call.name}", "arguments": {{"cmd": "cat setup.cfg\n</tool_call>'

    def end(self, answer, options):
        return "<|im_end|>"


class QwenXml(Hermes):
    """Qwen3.5 / Qwen3.6: qwen3_coder XML in ``<tool_call>`` blocks."""

    def calls(self, calls, ids):
        return "\n".join(self._call(c) for c in calls)

    @staticmethod
    def _call(call: Call) -> str:
        params = "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else _json(v)}\n</parameter>\n"
            for k, v in call.arguments.items()
        )
        return f"<tool_call>\n<function={call.name}>\n{params}</function>\n</tool_call>"

    def malformed(self, call):  # no <function=...> element
        return "<tool_call>\n<parameter=cmd>\ncat setup.cfg\n</parameter>\n</tool_call>"


class Llama(Writer):
    """Llama 3.x: a bare JSON object per call (``parameters``), no reasoning."""

    reasons = False

    def reasoning(self, text, prompt):
        return ""

    def calls(self, calls, ids):
        return "; ".join(_json({"name": c.name, "parameters": c.arguments}) for c in calls)

    def malformed(self, call):
        return f'{{"name": "{call.name}", "parameters": {{"cmd": "cat setup.cfg'

    def end(self, answer, options):
        if answer.kind != "final" and "eom" in options:
            return "<|eom_id|>"
        return "<|eot_id|>"


class Harmony(Writer):
    """gpt-oss: an analysis message, then a commentary call or the final message (the
    prompt ends with ``<|start|>assistant``)."""

    def reasoning(self, text, prompt):
        if not text:
            return ""
        return f"<|channel|>analysis<|message|>{text}<|end|><|start|>assistant"

    # no preamble: the template refuses a call's message with both content and thinking

    def messages(self, prompt):
        """``<|start|>ROLE ...<|message|>BODY<|end|>`` blocks; a tool's result (role
        ``functions.NAME``, its body JSON text) as its text."""
        out = []
        for block in prompt.split("<|start|>")[1:]:
            header, found, body = block.partition("<|message|>")
            if not found:
                continue  # the generation prompt
            role = re.match(r"[^\s<]*", header).group()
            body = re.split(r"<\|(?:end|call|return)\|>", body)[0]
            if role.startswith("functions."):
                role, body = "tool", _json_text(body)
            out.append({"role": role, "content": body})
        return out

    def calls(self, calls, ids):
        if len(calls) != 1:
            raise ValueError("harmony ends a turn at its first call: one call a turn")
        call = calls[0]
        head = f"<|channel|>commentary to=functions.{call.name} <|constrain|>json<|message|>"
        return head + _json(call.arguments, compact=True)

    def malformed(self, call):
        head = f"<|channel|>commentary to=functions.{call.name} <|constrain|>json<|message|>"
        return head + '{"cmd":"cat setup.cfg'

    def final(self, text):
        return f"<|channel|>final<|message|>{text}"

    def end(self, answer, options):
        return "<|return|>" if answer.kind == "final" else "<|call|>"


class DeepSeek(Writer):
    """DeepSeek V3 (``function<｜tool▁sep｜>NAME`` and fenced JSON) or V3.1 (``NAME<｜tool▁sep｜>``
    and bare JSON), as the template writes a call."""

    def __init__(self, template: str) -> None:
        super().__init__(template)
        self.v3 = "tool['type'] + '<｜tool▁sep｜>'" in template

    def reasoning(self, text, prompt):
        if prompt.endswith("<think>"):  # V3.1 thinking
            return f"{text}</think>"
        return super().reasoning(text, prompt)

    def _call(self, name: str, arguments: str) -> str:
        if self.v3:
            body = f"function<｜tool▁sep｜>{name}\n```json\n{arguments}\n```"
        else:
            body = f"{name}<｜tool▁sep｜>{arguments}"
        return f"<｜tool▁call▁begin｜>{body}<｜tool▁call▁end｜>"

    def calls(self, calls, ids):
        sep = "\n" if self.v3 else ""
        inner = sep.join(self._call(c.name, _json(c.arguments)) for c in calls)
        return f"<｜tool▁calls▁begin｜>{inner}<｜tool▁calls▁end｜>"

    def malformed(self, call):
        inner = self._call(call.name, '{"cmd": "cat setup.cfg')
        return f"<｜tool▁calls▁begin｜>{inner}<｜tool▁calls▁end｜>"

    def end(self, answer, options):
        return "<｜end▁of▁sentence｜>"


class Mistral(Writer):
    """Mistral: ``[TOOL_CALLS]`` then a JSON list with 9-character ids (v3, what the
    Nemo template writes), or ``NAME[ARGS]{...}`` per call (v11+ templates)."""

    def __init__(self, template: str) -> None:
        super().__init__(template)
        self.args_token = "[ARGS]" in template
        self.reasons = "[THINK]" in template

    def reasoning(self, text, prompt):
        return f"[THINK]{text}[/THINK]" if self.reasons else ""

    def calls(self, calls, ids):
        if self.args_token:
            return "".join(f"[TOOL_CALLS]{c.name}[ARGS]{_json(c.arguments)}" for c in calls)
        items = (
            f'{{"name": "{c.name}", "arguments": {_json(c.arguments)}, "id": "{i}"}}'
            for c, i in zip(calls, ids, strict=True)
        )
        return "[TOOL_CALLS][" + ", ".join(items) + "]"

    def malformed(self, call):
        if self.args_token:
            return f'[TOOL_CALLS]{call.name}[ARGS]{{"cmd": "cat setup.cfg'
        return f'[TOOL_CALLS][{{"name": "{call.name}", "arguments": {{"cmd": "cat setup.cfg'

    def end(self, answer, options):
        return "</s>"


# the template's own markup names the format, most specific first
WRITERS: tuple[tuple[tuple[str, ...], type[Writer]], ...] = (
    (("<|channel|>",), Harmony),
    (("<function=", "<parameter="), QwenXml),
    (("<tool_call>", "<|im_start|>"), Hermes),
    (("<|start_header_id|>",), Llama),
    (("<｜tool▁calls▁begin｜>",), DeepSeek),
    (("[TOOL_CALLS]",), Mistral),
)


def writer_for(template: str) -> Writer:
    for marks, writer in WRITERS:
        if all(m in template for m in marks):
            return writer(template)
    raise ValueError("no known tool-call format in this chat template")


def call_ids(prompt_ids: list[int], n: int) -> list[str]:
    """Tool call ids as Mistral's templates want them (9 letters or digits), stable for a
    prompt."""
    seed = hashlib.sha1(repr(prompt_ids).encode()).hexdigest()
    return [hashlib.sha1(f"{seed}:{i}".encode()).hexdigest()[:9] for i in range(n)]


def logprob(position: int, token_id: int) -> float:
    """A deterministic logprob in [-3, 0)."""
    h = int.from_bytes(hashlib.sha1(f"{position}:{token_id}".encode()).digest()[:4], "big")
    return -3.0 * (h + 1) / 2**32


@dataclass(frozen=True)
class Written:
    """An answer as the engine gives it back: the ids, and the message a chat parser
    reads from them."""

    answer: Answer
    output_ids: list[int]
    finish: str  # stop | length
    end_id: int
    message: dict[str, Any]
    text: str


# -- the engine -------------------------------------------------------------------------
@dataclass
class Served:
    endpoint: str
    body: dict[str, Any]
    prompt_ids: list[int]
    written: Written


@dataclass
class FamilyEngine:
    model_dir: Path
    port: int = 0
    served: list[Served] = field(default_factory=list)
    script: Directives | PolicyScript = field(default_factory=Directives)

    def __post_init__(self) -> None:
        from transformers import AutoTokenizer

        self.model_dir = Path(self.model_dir)
        self.tok = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.writer = writer_for(self.tok.chat_template)
        # the official template joins argument text into the prompt: it gets the text
        self.text_arguments = "+ tool['function']['arguments']" in self.tok.chat_template
        self.port = self.port or localservers.free_port()
        self.name = f"fake-{self.model_dir.name}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- answering (pure but for the tokenizer) ----------------------------------------
    def write(self, prompt_ids: list[int], max_new: int | None) -> Written:
        prompt = self.tok.decode(prompt_ids, skip_special_tokens=False)
        answer, options = self.script.read(prompt, self.writer)
        ids = call_ids(prompt_ids, len(answer.calls))
        w = self.writer
        reasoning = w.reasoning(answer.reasoning, prompt) if w.reasons else ""
        if answer.kind == "final":
            body = w.final(answer.text)
        elif answer.kind == "malformed":
            body = w.malformed(answer.calls[0])
        else:
            body = w.preamble(answer.text) + w.calls(answer.calls, ids)
        end = w.end(answer, options)
        end_id = self.tok.convert_tokens_to_ids(end)
        if end_id is None:
            raise ValueError(f"{self.model_dir.name}: the vocabulary has no {end}")
        output = self.tok.encode(reasoning + body, add_special_tokens=False) + [end_id]
        finish = "stop"
        if max_new is not None and len(output) > max_new:
            output, finish = output[:max_new], "length"
        message = self._message(answer, reasoning, body, ids, output, finish)
        text = self.tok.decode(output, skip_special_tokens=True)
        return Written(answer, output, finish, end_id, message, text)

    def _message(self, answer, reasoning, body, ids, output, finish) -> dict[str, Any]:
        """What SGLang's reasoning and tool parsers make of the output."""
        if finish == "length":  # cut off: the text as it came
            return {
                "role": "assistant",
                "content": self.tok.decode(output, skip_special_tokens=True),
            }
        message: dict[str, Any] = {"role": "assistant", "content": None}
        if reasoning and answer.reasoning:
            message["reasoning_content"] = answer.reasoning
        if answer.kind == "final":
            message["content"] = answer.text
        elif answer.kind == "malformed":
            message["content"] = self.tok.decode(
                self.tok.encode(body, add_special_tokens=False), skip_special_tokens=True
            )
        else:
            if self.writer.preamble(answer.text):
                message["content"] = answer.text
            message["tool_calls"] = [
                {
                    "id": call_id,
                    "type": "function",
                    "index": i,
                    "function": {"name": c.name, "arguments": _json(c.arguments)},
                }
                for i, (c, call_id) in enumerate(zip(answer.calls, ids, strict=True))
            ]
        return message

    def chat_prompt_ids(self, body: dict[str, Any]) -> list[int]:
        """The request templated as SGLang does: tool-call arguments as mappings (unless
        the template joins their text), ``chat_template_kwargs`` as template variables."""
        messages = [self._templated(m) for m in body.get("messages") or []]
        text = self.tok.apply_chat_template(
            messages,
            tools=body.get("tools") or None,
            add_generation_prompt=True,
            tokenize=False,
            **(body.get("chat_template_kwargs") or {}),
        )
        return self.tok.encode(text, add_special_tokens=False)

    def _templated(self, message: dict[str, Any]) -> dict[str, Any]:
        calls = message.get("tool_calls")
        if not calls or self.text_arguments:
            return message
        out = []
        for call in calls:
            fn = dict(call.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    pass
            out.append({**call, "function": fn})
        return {**message, "tool_calls": out}

    # -- HTTP ---------------------------------------------------------------------------
    def _meta(self, w: Written, prompt_ids: list[int], rid: str) -> dict[str, Any]:
        if w.finish == "stop":
            finish: dict[str, Any] = {"type": "stop", "matched": w.end_id}
        else:
            finish = {"type": "length", "length": len(w.output_ids)}
        return {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(w.output_ids),
            "cached_tokens": 0,
            "weight_version": WEIGHT_VERSION,
            "output_token_logprobs": [[logprob(i, t), t, None] for i, t in enumerate(w.output_ids)],
        }

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        prompt_ids = list(body["input_ids"])
        max_new = (body.get("sampling_params") or {}).get("max_new_tokens")
        w = self.write(prompt_ids, max_new)
        self.served.append(Served("/generate", body, prompt_ids, w))
        rid = f"gen-{len(self.served)}"
        return web.json_response(
            {
                "text": w.text,
                "output_ids": w.output_ids,
                "meta_info": self._meta(w, prompt_ids, rid),
            }
        )

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        try:
            prompt_ids = self.chat_prompt_ids(body)
        except Exception as exc:  # the template refused it: SGLang answers 400
            message = f"chat template error: {exc}"
            return web.json_response(
                {"object": "error", "message": message, "code": 400}, status=400
            )
        max_new = body.get("max_completion_tokens") or body.get("max_tokens")
        w = self.write(prompt_ids, max_new)
        self.served.append(Served("/v1/chat/completions", body, prompt_ids, w))
        rid = f"chatcmpl-{len(self.served)}"
        finish = w.finish
        if finish == "stop" and w.message.get("tool_calls"):
            finish = "tool_calls"
        choice = {
            "index": 0,
            "message": w.message,
            "logprobs": None,
            "finish_reason": finish,
            "matched_stop": w.end_id if w.finish == "stop" else None,
            "prompt_token_ids": prompt_ids,
            "token_ids": w.output_ids,
            "meta_info": self._meta(w, prompt_ids, rid),
        }
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(w.output_ids),
            "total_tokens": len(prompt_ids) + len(w.output_ids),
        }
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model") or self.name,
                "choices": [choice],
                "usage": usage,
                "metadata": {"weight_version": WEIGHT_VERSION},
            }
        )

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": str(self.model_dir),
                "tokenizer_path": str(self.model_dir),
                "is_generation": True,
                "weight_version": WEIGHT_VERSION,
            }
        )

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"version": SGLANG_VERSION, "served_model_name": self.name, "context_length": 131072}
        )

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/health", self._health)
        for path in ("/model_info", "/get_model_info"):
            app.router.add_get(path, self._model_info)
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, self._server_info)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    # -- lifecycle ----------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> FamilyEngine:
        ready = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            runner = web.AppRunner(self.app(), access_log=None)
            try:
                loop.run_until_complete(runner.setup())
                loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
            except BaseException as exc:  # a port taken: the caller raises it
                failed.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(runner.cleanup())
                loop.close()

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise RuntimeError(f"{self.name} did not start in {timeout} s")
        if failed:
            raise failed[0]
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


@contextmanager
def family_engine(
    model_dir: Path, script: Directives | PolicyScript | None = None
) -> Iterator[FamilyEngine]:
    engine = FamilyEngine(model_dir, script=script or Directives()).start()
    try:
        yield engine
    finally:
        engine.stop()
