"""Start-up probe verdicts (pure): can this server give us token ids, or do we refuse?

Each client runs a one-token request per upstream mode it must serve and hands the
answer to the same parser real traffic uses; whatever that parser rejects is a problem,
and any problem refuses start with a message naming the server, version and what was
missing. The token-mode probe's prompt is the probe message through the served model's
own tokenizer and chat template (``prompt_ids``): an id the model does not have would
be refused by a correct engine.

Start-up waits only for an engine that is not up yet (``not_ready``: no answer, 502,
503, 504, 429, a timeout); any other answer (a 4xx, a 500 with its reason) is the
engine's deterministic verdict, reported at once (``probe_refused``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from proxy.backends.base import BackendCapabilityError, BackendError, ErrorKind, SamplingParams

PROBE_MESSAGES = [{"role": "user", "content": "Reply with OK."}]
PROBE_SAMPLING = SamplingParams(temperature=0.0, max_new_tokens=1)
PROBE_INPUT_IDS = [0]  # only without a tokenizer (chat-mode callers, tests): its ids win
ProbeIds = Callable[[], list[int]]  # called once the engine answers (its model dir exists)
_STARTING = frozenset({ErrorKind.UNAVAILABLE, ErrorKind.TIMEOUT, ErrorKind.OVERLOADED})

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


def prompt_ids(tokenizer: Any) -> list[int]:
    """The probe message as the served model's template renders it: ids it has."""
    return tokenizer.render_ids(PROBE_MESSAGES)


def token_probe_ids(input_ids: ProbeIds | None) -> list[int]:
    return PROBE_INPUT_IDS if input_ids is None else input_ids()


def not_ready(exc: BackendError) -> bool:
    """The engine is still starting (or busy) rather than refusing what was asked:
    connection refused or reset, 502/503/504, 429, a timeout."""
    return not isinstance(exc, BackendCapabilityError) and exc.kind in _STARTING


def probe_refused(exc: BackendError) -> BackendCapabilityError:
    """An engine's answer to the start-up probe that waiting will not change."""
    status = f"HTTP {exc.status}" if exc.status is not None else exc.kind.value
    where = exc.worker or "the engine"
    return BackendCapabilityError(
        f"{where} refused the start-up probe ({status}): {exc.message}. "
        "Not retried: the engine answered, so waiting will not change it",
        worker=exc.worker,
    )
