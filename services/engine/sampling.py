"""Sampling and stopping: pure functions over logits and token lists.

The logprob reported for a token is ``log_softmax(raw_logits)[token]``: the model's own
distribution at temperature 1, before temperature, top-k, top-p or min-p reshape the
sampling distribution. That is the quantity a trainer recomputes from the weights, so it
is what the engine reports (SGLang reports the same by default). Randomness comes from a
per-request uniform draw, so a request's tokens do not depend on what else is batched.
"""

from __future__ import annotations

import torch
from msgspec import Struct


class SamplingParams(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """SGLang's ``sampling_params`` (the subset the embedded engine implements)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no limit
    min_p: float = 0.0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None


def validate(params: SamplingParams) -> str | None:
    """A message for the first invalid field, or None."""
    if params.max_new_tokens < 0:
        return "max_new_tokens must be >= 0"
    if params.temperature < 0:
        return "temperature must be >= 0"
    if not 0 < params.top_p <= 1:
        return "top_p must be in (0, 1]"
    if not 0 <= params.min_p <= 1:
        return "min_p must be in [0, 1]"
    if params.top_k < -1:
        return "top_k must be -1 (disabled) or >= 0"
    return None


def filtered_distribution(
    logits: torch.Tensor, params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, token_ids) per row, sorted by descending probability, with temperature,
    top-k, top-p and min-p applied (filtered entries have probability 0, not renormalized)."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)[:, None]
    ranked, order = torch.sort(logits / temps, dim=-1, descending=True, stable=True)
    probs = torch.softmax(ranked, dim=-1)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab)[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])[:, None]
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype)[:, None]
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype)[:, None]
    before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each rank
    keep = (ranks < top_k) & ((before < top_p) | (top_p >= 1)) & (probs >= min_p * probs[:, :1])
    keep[:, 0] = True
    return probs * keep, order


def _needs_filter(p: SamplingParams) -> bool:
    return p.top_k > 0 or p.top_p < 1 or p.min_p > 0


def _inverse_cdf(probs: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    cdf = probs.cumsum(dim=-1)
    target = torch.tensor(uniforms, dtype=cdf.dtype)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).clamp(max=cdf.shape[-1] - 1)


def _draw(logits: torch.Tensor, params: list[SamplingParams], uniforms: list[float]) -> list[int]:
    """Sample rows by inverse CDF; unfiltered rows skip the sort (vocabulary order)."""
    if not any(_needs_filter(p) for p in params):
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)[:, None]
        return _inverse_cdf(torch.softmax(logits / temps, dim=-1), uniforms)[:, 0].tolist()
    probs, order = filtered_distribution(logits, params)
    return order.gather(1, _inverse_cdf(probs, uniforms))[:, 0].tolist()


def choose_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    uniforms: list[float],
    forced: list[int | None],
    banned: list[list[int]] | None = None,
) -> tuple[list[int], list[float]]:
    """One next token per row and its raw logprob.

    A row with a forced token (scripted policy) takes it; temperature 0 is greedy; other
    rows draw by inverse CDF with their uniform in [0, 1) over the filtered distribution.
    ``banned`` ids of a row cannot be chosen (stop ids before ``min_new_tokens``); they
    change the choice, never the reported logprobs.
    """
    raw = logits
    if banned and any(banned):
        logits = logits.clone()
        for row, ids in enumerate(banned):
            if ids:
                logits[row, ids] = float("-inf")
    tokens: list[int | None] = list(forced)
    greedy = [i for i, p in enumerate(params) if tokens[i] is None and p.temperature == 0]
    if greedy:
        for i, token in zip(greedy, logits[greedy].argmax(dim=-1).tolist(), strict=True):
            tokens[i] = token
    for group in (
        [i for i, t in enumerate(tokens) if t is None and not _needs_filter(params[i])],
        [i for i, t in enumerate(tokens) if t is None and _needs_filter(params[i])],
    ):
        if group:
            drawn = _draw(logits[group], [params[i] for i in group], [uniforms[i] for i in group])
            for i, token in zip(group, drawn, strict=True):
                tokens[i] = token
    chosen = torch.log_softmax(raw, dim=-1).gather(1, torch.tensor(tokens)[:, None])
    return tokens, chosen[:, 0].tolist()


def banned_ids(params: SamplingParams, produced: int, eos_ids: list[int]) -> list[int]:
    """Stop ids a request may not sample yet (it has fewer than ``min_new_tokens``)."""
    if produced >= params.min_new_tokens:
        return []
    return list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_ids))


def stop_token_hit(token: int, produced: int, params: SamplingParams, eos_ids: list[int]) -> bool:
    if produced < params.min_new_tokens:
        return False
    return token in params.stop_token_ids or (not params.ignore_eos and token in eos_ids)


def stop_string_hit(tail_text: str, params: SamplingParams, produced: int) -> str | None:
    """The first stop string found in the decoded tail of the output, if any."""
    if produced < params.min_new_tokens:
        return None
    for stop in params.stop:
        if stop and stop in tail_text:
            return stop
    return None


def tail_window(params: SamplingParams) -> int:
    """How many trailing tokens to decode to see any stop string (byte-level tokens may
    carry as little as one byte, and a character is at most four)."""
    longest = max((len(s) for s in params.stop), default=0)
    return 4 * longest + 2


def trim_at_stop(text: str, stop: str | None, params: SamplingParams) -> str:
    if stop is None or params.no_stop_trim:
        return text
    index = text.find(stop)
    return text if index < 0 else text[:index]
