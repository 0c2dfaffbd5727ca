"""Start-up probe verdicts (pure): can this server give us token ids, or do we refuse?

Each client runs a one-token request per upstream mode it must serve and hands the
answer to the same parser real traffic uses; whatever that parser rejects is a problem,
and any problem refuses start with a message naming the server, version and what was
missing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from proxy.backends.base import BackendCapabilityError, BackendError, SamplingParams

PROBE_MESSAGES = [{"role": "user", "content": "Reply with OK."}]
PROBE_SAMPLING = SamplingParams(temperature=0.0, max_new_tokens=1)
PROBE_INPUT_IDS = [0]  # the token the engines' own health checks generate from

HINTS = {
    ("sglang", "chat"): (
        "SGLang returns prompt and output token ids on /v1/chat/completions from 0.5.13 on "
        "(return_prompt_token_ids, return_meta_info): upgrade it, or run the proxy in upstream "
        "token mode (/generate)"
    ),
    ("sglang", "token"): "SGLang's /generate must return meta_info.output_token_logprobs",
    ("vllm", "chat"): (
        "vLLM returns prompt_token_ids and choices[].token_ids from 0.10.2 on "
        "(return_token_ids): upgrade it, or run the proxy in upstream token mode"
    ),
    ("vllm", "token"): (
        "vLLM must answer /inference/v1/generate, or /v1/completions with token ids "
        "(return_token_ids, or return_tokens_as_token_ids with logprobs)"
    ),
}


def problems_of(parse: Callable[[], Any]) -> list[str]:
    """Run the real parser on a probe answer; its complaints are the problems."""
    try:
        parse()
    except BackendError as exc:
        return [exc.message]
    return []


def refusal(
    server: str, version: str | None, url: str, mode: str, problems: list[str]
) -> BackendCapabilityError:
    shown = f"{server} {version}" if version else f"{server} (version unknown)"
    hint = HINTS.get((server, mode), "")
    return BackendCapabilityError(
        f"{shown} at {url} cannot serve upstream {mode} mode token-exactly: "
        f"{'; '.join(problems)}. {hint}. Refusing to start rather than train on "
        "retokenized text.",
        worker=url,
    )


def int_or_none(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None
