"""One request's life inside the engine: what it asked for, what it produced, why it ended."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from msgspec import Struct

from services.engine.model import KVCache
from services.engine.sampling import (
    SamplingParams,
    stop_string_hit,
    stop_token_hit,
    tail_window,
    trim_at_stop,
)
from services.engine.vision import RequestImages, SequenceImages

Decode = Callable[[list[int], bool], str]


class GenerationRequest(Struct, frozen=True, kw_only=True):
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    forced_ids: list[int] | None = None  # scripted policy: emit exactly these tokens
    images: RequestImages | None = None
    return_routed_experts: bool = False  # an MoE model's routing rows in the result


class GenerationResult(Struct, frozen=True, kw_only=True):
    """What the engine hands back. ``finish_reason`` has SGLang's shape:
    ``{"type": "stop", "matched": id|str}``, ``{"type": "length", "length": n}`` or
    ``{"type": "abort", "message": ...}``. ``weight_version`` is the version that produced
    the last token; ``weight_versions[i]`` produced tokens from ``weight_version_starts[i]``
    on (more than one entry only when weights changed while the request was paused).
    ``routed_experts`` (asked for with ``return_routed_experts``): int32 [rows, MoE layers,
    top_k], the experts the forward routed positions ``[0, len(prompt) + len(output) - 1)``
    of prompt + output to, as held with the KV cache the last token was sampled from; None
    when not asked for, or when the request ended before computing them all (an abort)."""

    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    text: str
    finish_reason: dict[str, Any]
    weight_version: str
    weight_versions: list[str]
    weight_version_starts: list[int]
    cached_tokens: int
    queue_seconds: float
    e2e_seconds: float
    routed_experts: Any = None  # a torch.Tensor when asked for


class Sequence:
    """Mutable engine-side state of one request."""

    def __init__(self, request: GenerationRequest, on_done: Callable[[GenerationResult], None]):
        self.request = request
        self.params = request.params
        self.on_done = on_done
        seed = request.params.sampling_seed
        self.rng = random.Random(
            seed if seed is not None else random.SystemRandom().getrandbits(64)
        )
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[tuple[str, int]] = []
        self.cache: KVCache | None = None
        self.images: SequenceImages | None = None  # encoded with the cache's weights
        self.cached_tokens = 0
        self.finish: dict[str, Any] | None = None
        self.matched_stop: str | None = None
        self.arrived = time.monotonic()
        self.admitted: float | None = None

    def tokens(self) -> list[int]:
        return self.request.prompt_ids + self.output_ids

    def cache_key(self) -> list[int]:
        """``tokens()`` as the prefix cache compares them: each image's pad tokens become
        a negative number drawn from its digest, so a cached prefix is reused only for
        the same images at the same places."""
        tokens = self.tokens()
        if self.request.images is None:
            return tokens
        for (start, length), digest in zip(
            self.request.images.spans, self.request.images.digests, strict=True
        ):
            tokens[start : start + length] = [-1 - int(digest[-15:], 16)] * length
        return tokens

    def pending(self) -> list[int]:
        """Tokens not yet in the KV cache (whole prompt, its tail, or the last sample)."""
        done, prompt = self.cache.length, self.request.prompt_ids
        if done >= len(prompt):
            return self.output_ids[done - len(prompt) :]
        return prompt[done:] + self.output_ids

    def forced_token(self) -> int | None:
        forced = self.request.forced_ids
        if forced is None:
            return None
        return forced[len(self.output_ids)] if len(self.output_ids) < len(forced) else None

    def append(self, token: int, logprob: float, version: str) -> None:
        if not self.versions or self.versions[-1][0] != version:
            self.versions.append((version, len(self.output_ids)))
        self.output_ids.append(token)
        self.logprobs.append(logprob)

    def update_finish(self, decode: Decode, eos_ids: list[int], context_limit: int) -> None:
        """Decide whether the token just appended ends the request."""
        p, produced, token = self.params, len(self.output_ids), self.output_ids[-1]
        if stop_token_hit(token, produced, p, eos_ids):
            self.finish = {"type": "stop", "matched": token}
            return
        if p.stop:
            tail = decode(self.output_ids[-tail_window(p) :], False)
            hit = stop_string_hit(tail, p, produced)
            if hit is not None:
                self.finish, self.matched_stop = {"type": "stop", "matched": hit}, hit
                return
        forced = self.request.forced_ids
        if forced is not None and produced >= len(forced):
            self.finish = {"type": "stop", "matched": token}
        elif (
            produced >= p.max_new_tokens or len(self.request.prompt_ids) + produced >= context_limit
        ):
            self.finish = {"type": "length", "length": produced}

    def abort(self, message: str) -> None:
        self.finish = {"type": "abort", "message": message}

    def result(
        self, decode: Decode, current_version: str, routed_experts: Any = None
    ) -> GenerationResult:
        text = decode(self.output_ids, self.params.skip_special_tokens)
        text = trim_at_stop(text, self.matched_stop, self.params)
        versions = self.versions or [(current_version, 0)]
        now = time.monotonic()
        return GenerationResult(
            rid=self.request.rid,
            prompt_ids=self.request.prompt_ids,
            output_ids=self.output_ids,
            output_logprobs=self.logprobs,
            text=text,
            finish_reason=self.finish or {"type": "abort", "message": "unfinished"},
            weight_version=versions[-1][0],
            weight_versions=[v for v, _ in versions],
            weight_version_starts=[s for _, s in versions],
            cached_tokens=self.cached_tokens,
            queue_seconds=(self.admitted or now) - self.arrived,
            e2e_seconds=now - self.arrived,
            routed_experts=routed_experts,
        )
