"""SGLang request bodies and response parsing (pure).

Shapes by version (tests/fixtures/backends/sglang/*, README there says where each came from):
  /generate           {text, output_ids?, meta_info{id, finish_reason{type, matched|length|
                      message}, prompt_tokens, completion_tokens, weight_version?,
                      output_token_logprobs[[logprob, token_id, text|null], ...],
                      weight_versions?, weight_version_starts? (the embedded server's:
                      the versions a request spanned, and the output index each began)}}
                      ``output_ids`` is top level from 0.5 on; older servers only have the
                      ids inside ``output_token_logprobs``.
  chat completions    choice.prompt_token_ids (return_prompt_token_ids, >= 0.5.13),
                      choice.meta_info (return_meta_info, >= 0.5.13) with the same
                      output_token_logprobs, choice.token_ids (return_token_ids, newer),
                      top-level metadata.weight_version (newer).
Before 0.5.13 the chat endpoint silently ignores the extra flags, so the answer carries no
ids at all: the probe refuses that instead of training on retokenized text.
"""

from __future__ import annotations

from typing import Any

import msgspec

from proxy.backends.base import Generation, TokenRequest
from proxy.backends.routed import answer_rows, sglang_rows
from proxy.backends.wire import (
    bad_response,
    chat_body,
    content_logprobs,
    float_logprobs,
    ids_of,
    int_ids,
    matched_stop,
    normalize_finish,
    parse_tool_calls,
    reasoning_text,
)

_TRIPLES = list[tuple[float, int, Any]]  # output_token_logprobs as SGLang sends it

CHAT_FLAGS = {"return_prompt_token_ids": True, "return_token_ids": True, "return_meta_info": True}


def build_chat_body(req: Any, default_model: str) -> dict[str, Any]:
    body = chat_body(req, default_model)
    body.update(CHAT_FLAGS)
    return body


def build_generate_body(req: TokenRequest) -> dict[str, Any]:
    s = req.sampling
    params: dict[str, Any] = {}
    for key in ("temperature", "top_p", "top_k", "max_new_tokens"):
        if (value := getattr(s, key)) is not None:
            params[key] = value
    if s.stop:
        params["stop"] = list(s.stop)
    if s.stop_token_ids:
        params["stop_token_ids"] = list(s.stop_token_ids)
    if s.seed is not None:
        params["sampling_seed"] = s.seed  # SGLang's name; absent on old servers
    params.update(s.extra)
    body = {
        "input_ids": req.input_ids,
        "sampling_params": params,
        "return_logprob": True,
        "logprob_start_len": -1,  # output logprobs only; no prompt scoring pass
        "stream": False,
    }
    if req.image_data:
        body["image_data"] = list(req.image_data)
    if req.routing is not None:  # the server needs --enable-return-routed-experts
        body["return_routed_experts"] = True
    return body


def output_pairs(meta: dict[str, Any], worker: str = "") -> tuple[list[int], list[float]] | None:
    """(ids, logprobs) from ``meta_info``, whichever of the three shapes it uses."""
    entries = meta.get("output_token_logprobs")
    if entries is not None:
        if not isinstance(entries, list):
            raise bad_response("meta_info.output_token_logprobs is not a list", worker)
        try:  # the usual shape, [logprob, token_id, text|null] each: checked in C
            triples = msgspec.convert(entries, _TRIPLES)
        except msgspec.ValidationError:
            triples = None
        if triples is not None:
            if not triples:
                return [], []
            lps, ids, _ = zip(*triples, strict=True)
            return list(ids), list(lps)
        ids, lps = [], []
        for entry in entries:
            if isinstance(entry, dict):  # {"logprob": .., "token_id": ..}
                lp, tid = entry.get("logprob"), entry.get("token_id", entry.get("id"))
            else:  # [logprob, token_id, text|null]
                lp, tid = entry[0], entry[1]
            ids.append(tid)
            lps.append(lp)
        return int_ids(ids, "output_token_logprobs", worker), float_logprobs(
            lps, "meta_info.output_token_logprobs", worker
        )
    if "output_token_logprobs_val" in meta and "output_token_logprobs_idx" in meta:
        ids = int_ids(meta["output_token_logprobs_idx"], "output_token_logprobs_idx", worker)
        lps = float_logprobs(meta["output_token_logprobs_val"], "output_token_logprobs_val", worker)
        return ids, lps
    return None


def weight_spans(
    meta: dict[str, Any], n_output: int, worker: str = ""
) -> tuple[list[str], list[int]]:
    """``(weight_versions, weight_version_starts)`` when the server sends them, else empty:
    which weights produced which part of the output (a request paused across a swap)."""
    versions, starts = meta.get("weight_versions"), meta.get("weight_version_starts")
    if versions is None and starts is None:
        return [], []
    if (
        not isinstance(versions, list)
        or not isinstance(starts, list)
        or len(versions) != len(starts)
    ):
        raise bad_response("meta_info.weight_versions and weight_version_starts differ", worker)
    begins = int_ids(starts, "meta_info.weight_version_starts", worker)
    if begins and (begins[0] != 0 or begins != sorted(begins) or begins[-1] > n_output):
        raise bad_response(
            f"meta_info.weight_version_starts {begins} do not split {n_output} output tokens",
            worker,
        )
    return [str(v) for v in versions], begins


def _check_same(ids: list[int], other: Any, what: str, worker: str) -> None:
    if other is not None and list(other) != ids:
        raise bad_response(f"{what} disagrees with meta_info.output_token_logprobs", worker)


def parse_generate(
    body: dict[str, Any], req: TokenRequest, worker: str = "", served_model: str = ""
) -> Generation:
    meta = body.get("meta_info") or {}
    pairs = output_pairs(meta, worker)
    if pairs is None:
        raise bad_response("/generate answer has no meta_info.output_token_logprobs", worker)
    ids, lps = pairs
    _check_same(ids, body.get("output_ids", meta.get("output_ids")), "output_ids", worker)
    prompt_tokens = meta.get("prompt_tokens")
    if prompt_tokens is not None and prompt_tokens != len(req.input_ids):
        raise bad_response(
            f"server counted {prompt_tokens} prompt tokens, {len(req.input_ids)} were sent", worker
        )
    finish = meta.get("finish_reason")
    versions, starts = weight_spans(meta, len(ids), worker)
    return Generation(
        prompt_ids=list(req.input_ids),
        output_ids=ids,
        output_logprobs=lps,
        finish_reason=normalize_finish(finish),
        matched_stop=matched_stop(finish),
        weight_version=_version(meta.get("weight_version")),
        weight_versions=versions,
        weight_version_starts=starts,
        text=body.get("text") or "",
        served_model=served_model,
        worker=worker,
        routing=answer_rows(req, meta.get("routed_experts"), len(ids), sglang_rows, worker),
    )


def chat_prompt_ids(body: dict[str, Any], choice: dict[str, Any]) -> list[int] | None:
    for source in (choice, body, choice.get("meta_info") or {}):
        if source.get("prompt_token_ids") is not None:
            return ids_of(source["prompt_token_ids"])
    return None


def chat_output(choice: dict[str, Any], worker: str = "") -> tuple[list[int], list[float]]:
    """Output ids and logprobs of a chat choice.

    ``meta_info.output_token_logprobs`` is complete whenever present; the choice's own
    ``token_ids`` + ``logprobs.content`` are used only when they line up one to one.
    """
    pairs = output_pairs(choice.get("meta_info") or {}, worker)
    token_ids = choice.get("token_ids")
    if pairs is not None:
        _check_same(pairs[0], token_ids, "choice.token_ids", worker)
        return pairs
    if token_ids is None:
        raise bad_response(
            "chat answer has neither choice.token_ids nor meta_info.output_token_logprobs", worker
        )
    content = content_logprobs(choice)
    if content is None or len(content) != len(token_ids):
        got = "none" if content is None else len(content)
        raise bad_response(
            f"chat logprobs cover {got} of {len(token_ids)} output tokens and no "
            "meta_info.output_token_logprobs came back (return_meta_info)",
            worker,
        )
    lps = float_logprobs([c.get("logprob") for c in content], "logprobs.content", worker)
    return int_ids(token_ids, "choice.token_ids", worker), lps


def parse_chat(body: dict[str, Any], worker: str = "") -> Generation:
    choices = body.get("choices") or []
    if not choices:
        raise bad_response("chat answer has no choices", worker)
    choice = choices[0]
    prompt_ids = chat_prompt_ids(body, choice)
    if prompt_ids is None:
        raise bad_response("chat answer has no prompt_token_ids (return_prompt_token_ids)", worker)
    ids, lps = chat_output(choice, worker)
    message = choice.get("message") or {}
    meta = choice.get("meta_info") or {}
    version = meta.get("weight_version", (body.get("metadata") or {}).get("weight_version"))
    versions, starts = weight_spans(meta, len(ids), worker)
    return Generation(
        prompt_ids=prompt_ids,
        output_ids=ids,
        output_logprobs=lps,
        finish_reason=normalize_finish(choice.get("finish_reason")),
        matched_stop=matched_stop(None, choice),
        weight_version=_version(version),
        weight_versions=versions,
        weight_version_starts=starts,
        text=message.get("content") or "",
        reasoning=reasoning_text(message),
        tool_calls=parse_tool_calls(message),
        served_model=body.get("model") or "",
        worker=worker,
    )


def _version(value: Any) -> str | None:
    return None if value is None else str(value)
