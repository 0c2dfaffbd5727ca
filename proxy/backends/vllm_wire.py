"""vLLM request bodies and response parsing (pure).

Shapes by version (tests/fixtures/backends/vllm/*, README there says where each came from):
  chat completions   with ``return_token_ids`` (>= 0.10.2): top-level ``prompt_token_ids``,
                     ``choices[].token_ids``; ``logprobs.content[].logprob`` one per token.
                     Older servers ignore the flag (it is logged, not rejected).
  tokens in          ``POST /inference/v1/generate`` {token_ids, sampling_params} (newer)
                     answers {request_id, choices[{token_ids, logprobs.content, finish_reason}]};
                     otherwise ``POST /v1/completions`` with a token-id ``prompt``, where ids
                     come from ``choices[].token_ids`` or, on servers without
                     ``return_token_ids``, from ``logprobs.tokens`` spelled "token_id:N"
                     (``return_tokens_as_token_ids``).
                     0.32 (recorded): generate logprob entries are {token_id, logprob, rank,
                     top_logprobs}, no prompt echo, and ``choices[].weight_versions``
                     [{version, start, end}] spans of output positions ("default" before
                     any /update_weight_version: no version).
  stop tokens        the stop token is the last output id (and has a logprob); its
                     ``stop_reason`` is null for the tokenizer's end token, the id for a
                     generation_config extra end token, the string for a stop string.
  errors             flat {"object": "error", ...} before ~0.11, nested {"error": {...}} after.
"""

from __future__ import annotations

from typing import Any

from proxy.backends.base import ChatRequest, Generation, TokenRequest
from proxy.backends.routed import answer_rows, vllm_rows
from proxy.backends.wire import (
    bad_response,
    chat_body,
    content_logprobs,
    float_logprobs,
    int_ids,
    matched_stop,
    normalize_finish,
    openai_sampling,
    parse_tool_calls,
    reasoning_text,
    token_id_from_text,
)

GENERATE_PATH = "/inference/v1/generate"
COMPLETIONS_PATH = "/v1/completions"
_LOGPROBS = 1  # the sampled token's logprob is always included alongside the top-1
NO_VERSION = "default"  # vLLM's weight version before anyone set one


def version_or_none(value: Any) -> str | None:
    return None if value is None or str(value) == NO_VERSION else str(value)


def build_chat_body(req: ChatRequest, served_model: str) -> dict[str, Any]:
    """Always the served model's name: the harness's (``req.model``) is an alias only the
    proxy knows, and vLLM refuses a name it does not serve (404 "The model `m` does not
    exist")."""
    body = chat_body(req, served_model)
    body["model"] = served_model
    body["return_token_ids"] = True
    return body


def build_generate_body(req: TokenRequest, model: str) -> dict[str, Any]:
    params = openai_sampling(req.sampling)
    params["logprobs"] = _LOGPROBS
    if req.routing is not None:  # the server needs --enable-return-routed-experts
        params["routed_experts_prompt_start"] = req.routing.start
    return {"model": model, "token_ids": req.input_ids, "sampling_params": params, "stream": False}


def reload_weights_body(path: str) -> dict[str, Any]:
    """``POST /collective_rpc``: every worker reloads its weights from ``path``."""
    return {"method": "reload_weights", "kwargs": {"weights_path": path}}


def build_completions_body(req: TokenRequest, model: str) -> dict[str, Any]:
    body = openai_sampling(req.sampling)
    body.update(
        model=model,
        prompt=req.input_ids,
        logprobs=_LOGPROBS,
        return_token_ids=True,
        return_tokens_as_token_ids=True,
        stream=False,
    )
    if req.routing is not None:
        body["routed_experts_prompt_start"] = req.routing.start
    return body


def _ids_from_token_texts(tokens: list[Any], what: str, worker: str) -> list[int]:
    ids = [token_id_from_text(t) for t in tokens]
    if any(i is None for i in ids):
        raise bad_response(f"{what}: no token ids (return_token_ids unsupported?)", worker)
    return ids  # type: ignore[return-value]


def _content_output(choice: dict[str, Any], worker: str) -> tuple[list[int], list[float]]:
    """Ids and logprobs from ``token_ids`` + chat-style ``logprobs.content``."""
    content = content_logprobs(choice)
    if content is None:
        raise bad_response("answer has no logprobs.content (logprobs=true)", worker)
    if choice.get("token_ids") is not None:
        ids = int_ids(choice["token_ids"], "choices[0].token_ids", worker)
    else:
        ids = _ids_from_token_texts(
            [c.get("token") for c in content], "choices[0].token_ids", worker
        )
    if len(content) != len(ids):
        raise bad_response(f"logprobs cover {len(content)} of {len(ids)} output tokens", worker)
    return ids, float_logprobs([c.get("logprob") for c in content], "logprobs.content", worker)


def stop_matched(choice: dict[str, Any], ids: list[int]) -> int | str | None:
    """What ended a "stop" answer, as the embedded engine says it: the stop string, or
    the stop token id (vLLM leaves ``stop_reason`` null for the tokenizer's own end
    token, which is then the last output id)."""
    found = matched_stop(None, choice)
    if found is None and choice.get("finish_reason") in ("stop", "tool_calls") and ids:
        return ids[-1]
    return found


def weight_spans(
    choice: dict[str, Any], n_output: int, worker: str = ""
) -> tuple[list[str], list[int]]:
    """``(weight_versions, weight_version_starts)`` from ``choices[].weight_versions``
    (``[{version, start, end}]``), the embedded engine's shape; empty when absent or when
    no version was ever set."""
    spans = choice.get("weight_versions")
    if not spans:
        return [], []
    if not isinstance(spans, list) or not all(isinstance(x, dict) for x in spans):
        raise bad_response("choices[0].weight_versions is not a list of spans", worker)
    versions = [str(x.get("version")) for x in spans]
    starts = int_ids([x.get("start") for x in spans], "weight_versions[].start", worker)
    if starts and (starts[0] != 0 or starts != sorted(starts) or starts[-1] > n_output):
        raise bad_response(
            f"weight_versions starts {starts} do not split {n_output} output tokens", worker
        )
    if all(v == NO_VERSION for v in versions):
        return [], []
    return versions, starts


def _first_choice(body: dict[str, Any], worker: str) -> dict[str, Any]:
    choices = body.get("choices") or []
    if not choices:
        raise bad_response("answer has no choices", worker)
    return choices[0]


def parse_chat(
    body: dict[str, Any], worker: str = "", weight_version: str | None = None
) -> Generation:
    choice = _first_choice(body, worker)
    prompt = body.get("prompt_token_ids", choice.get("prompt_token_ids"))
    if prompt is None:
        raise bad_response("chat answer has no prompt_token_ids (return_token_ids)", worker)
    ids, lps = _content_output(choice, worker)
    message = choice.get("message") or {}
    return Generation(
        prompt_ids=int_ids(prompt, "prompt_token_ids", worker),
        output_ids=ids,
        output_logprobs=lps,
        finish_reason=normalize_finish(choice.get("finish_reason")),
        matched_stop=stop_matched(choice, ids),
        weight_version=weight_version,
        text=message.get("content") or "",
        reasoning=reasoning_text(message),
        tool_calls=parse_tool_calls(message),
        served_model=body.get("model") or "",
        worker=worker,
    )


def parse_generate(
    body: dict[str, Any], req: TokenRequest, worker: str = "", weight_version: str | None = None
) -> Generation:
    choice = _first_choice(body, worker)
    ids, lps = _content_output(choice, worker)
    return _token_generation(req, ids, lps, choice, body, worker, weight_version)


def parse_completions(
    body: dict[str, Any], req: TokenRequest, worker: str = "", weight_version: str | None = None
) -> Generation:
    choice = _first_choice(body, worker)
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict) or logprobs.get("token_logprobs") is None:
        raise bad_response("completions answer has no logprobs.token_logprobs", worker)
    if choice.get("token_ids") is not None:
        ids = int_ids(choice["token_ids"], "choices[0].token_ids", worker)
    else:
        ids = _ids_from_token_texts(logprobs.get("tokens") or [], "logprobs.tokens", worker)
    values = logprobs["token_logprobs"]
    if len(values) != len(ids):
        raise bad_response(f"logprobs cover {len(values)} of {len(ids)} output tokens", worker)
    lps = float_logprobs(values, "logprobs.token_logprobs", worker)
    echoed = choice.get("prompt_token_ids")
    if echoed is not None and list(echoed) != list(req.input_ids):
        raise bad_response("server's prompt_token_ids differ from the ids sent", worker)
    return _token_generation(req, ids, lps, choice, body, worker, weight_version)


def _token_generation(req, ids, lps, choice, body, worker, weight_version) -> Generation:
    versions, starts = weight_spans(choice, len(ids), worker)
    return Generation(
        prompt_ids=list(req.input_ids),
        output_ids=ids,
        output_logprobs=lps,
        finish_reason=normalize_finish(choice.get("finish_reason")),
        matched_stop=stop_matched(choice, ids),
        weight_version=versions[-1] if versions else weight_version,
        weight_versions=versions,
        weight_version_starts=starts,
        text=choice.get("text") or "",
        served_model=body.get("model") or "",
        worker=worker,
        routing=answer_rows(req, choice.get("routed_experts"), len(ids), vllm_rows, worker),
    )
