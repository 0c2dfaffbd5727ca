"""The generation engine: one background thread running continuous batching on CPU.

Requests wait in a bounded queue and join the running batch as soon as a slot is free;
every step runs one forward over the whole ragged batch (new prompts' chunks and one
decode token per running sequence), then samples one token for each sequence whose
pending tokens are all computed. Finished sequences leave at once, so many sessions make
progress together. Callers talk to the thread through futures; no torch work happens on
the caller's thread.

Weights (SGLang semantics): ``swap_weights`` drains in-flight requests on the old weights
(new ones wait) and then swaps and bumps ``weight_version``. ``pause("abort")`` ends every
queued and running request at once, reporting the tokens it has and the version that made
them; ``pause("in_place")`` freezes them with their caches; ``pause("retract")`` drops their
caches so they are recomputed on continue. Requests frozen across a swap continue on the
new weights (caches recomputed, so reported logprobs stay exact) and list both versions.

MoE routing: each sequence's KV cache holds the experts of every position it computed
(``model.py``), a reused prefix's included; a request that asks for them gets the rows of
the cache its last token was sampled from. A cache recomputed after a swap has the new
weights' rows for every position, as it has their keys and values.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch

from services.engine.config import EngineConfig
from services.engine.model import CausalLM
from services.engine.prefixcache import PrefixCache
from services.engine.sampling import banned_ids, choose_tokens
from services.engine.sequence import GenerationRequest, GenerationResult, Sequence
from services.engine.vision import place_images

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "in_place", "retract")


class QueueFull(Exception):
    """The waiting queue is at its bound; the caller should answer 503."""


class EngineStopped(Exception):
    pass


class RequestRejected(ValueError):
    """The request cannot run at all (empty prompt, over the context limit): a 400."""


class Engine:
    def __init__(
        self,
        model: CausalLM,
        decode: Callable[[list[int], bool], str],
        eos_ids: list[int],
        config: EngineConfig | None = None,
        weight_version: str = "1",
    ):
        self.model = model
        self.decode = decode
        self.eos_ids = list(eos_ids)
        self.config = config or EngineConfig()
        self.version = weight_version
        self.context_limit = self.config.context_limit or model.config.max_position_embeddings
        self.prefix_cache = PrefixCache(self.config.prefix_cache_tokens)
        vision = model.config.vision
        # image pads are the encoder's places in a prompt, never the model's to write
        self.never_sample = [vision.image_token_id] if vision is not None else []
        self.paused: str | None = None
        self.generated_tokens = 0
        self.steps = 0
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._commands: deque[Callable[[], None]] = deque()
        self._swap: tuple[CausalLM, str | None, Future] | None = None
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- caller side (any thread) -------------------------------------------------

    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._loop, name="polar-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def submit(self, request: GenerationRequest) -> Future[GenerationResult]:
        """Queue a request. Raises QueueFull, EngineStopped or RequestRejected."""
        if len(request.prompt_ids) >= self.context_limit:
            raise RequestRejected(
                f"prompt has {len(request.prompt_ids)} tokens; the context limit is {self.context_limit}"
            )
        if not request.prompt_ids:
            raise RequestRejected("prompt is empty")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_ids):
            raise RequestRejected(f"prompt has token ids outside the vocabulary [0, {vocab})")
        if request.images is not None and self.model.config.vision is None:
            raise RequestRejected("this model reads no images (it has no vision_config)")
        if request.return_routed_experts and self.model.config.moe is None:
            raise RequestRejected("this model is not a mixture of experts: it routes nothing")
        future: Future[GenerationResult] = Future()
        seq = Sequence(request, lambda result: _resolve(future, result))
        with self._cv:
            if not self.alive:
                raise EngineStopped("engine is not running")
            if len(self._waiting) >= self.config.max_queue:
                raise QueueFull(f"queue is full ({self.config.max_queue} waiting)")
            self._waiting.append(seq)
            self._cv.notify_all()
        return future

    def pause(self, mode: str = "abort") -> Future[None]:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}")
        return self._command(lambda: self._pause(mode))

    def resume(self) -> Future[None]:
        return self._command(self._resume)

    def flush_cache(self) -> Future[bool]:
        """Drop reusable caches; refused (False) while requests are queued or running."""
        return self._command(self._flush)

    def abort(self, rid: str | None = None) -> Future[int]:
        """Abort one request by id (or all with None); returns how many were aborted."""
        return self._command(lambda: self._abort(rid, "aborted by request"))

    def swap_weights(
        self, model: CausalLM, version: str | None = None, abort_all: bool = False
    ) -> Future[tuple[str, int]]:
        """Install ``model`` once in-flight requests are done (or aborted). The future gives
        the new weight version and how many paused requests carry over to it."""
        future: Future[tuple[str, int]] = Future()

        def install() -> None:
            if abort_all:
                self._abort(None, "aborted for weight update")
            if self._swap is not None:
                self._swap[2].set_exception(RuntimeError("superseded by a newer weight update"))
            self._swap = (model, version, future)

        self._command(install)
        return future

    def stats(self) -> dict:
        with self._cv:
            return {
                "weight_version": self.version,
                "running": len(self._running),
                "waiting": len(self._waiting),
                "paused": self.paused,
                "swap_pending": self._swap is not None,
                "prefix_cache_entries": len(self.prefix_cache),
                "prefix_cache_tokens": self.prefix_cache.tokens,
                "generated_tokens": self.generated_tokens,
                "steps": self.steps,
            }

    def _command(self, fn: Callable[[], object]) -> Future:
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except Exception as exc:  # surfaced to the caller through the future
                future.set_exception(exc)

        with self._cv:
            if not self.alive:
                raise EngineStopped("engine is not running")
            self._commands.append(run)
            self._cv.notify_all()
        return future

    # ---- engine thread ------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._has_work():
                    self._cv.wait(timeout=1.0)
                if self._stopping:
                    break
                while self._commands:
                    self._commands.popleft()()
                self._maybe_swap()
                self._admit()
                batch = [] if self.paused else list(self._running)
            if batch:
                self._step_safely(batch)
        self._shutdown()

    def _shutdown(self) -> None:
        with self._cv:
            while self._commands:  # let late control calls resolve rather than hang
                self._commands.popleft()()
            if self._swap is not None:
                self._swap[2].set_exception(EngineStopped("engine stopped before the weight swap"))
                self._swap = None
            self._abort(None, "server shutting down")

    def _has_work(self) -> bool:
        if self._commands:
            return True
        if self.paused:
            return False
        admissible = (
            self._waiting and self._swap is None and len(self._running) < self.config.max_batch
        )
        return bool(self._running or admissible or self._swap)

    def _admit(self) -> None:
        if self.paused or self._swap is not None:
            return
        while self._waiting and len(self._running) < self.config.max_batch:
            seq = self._waiting.popleft()
            if seq.admitted is None:
                seq.admitted = time.monotonic()
            if seq.params.max_new_tokens == 0:
                seq.finish = {"type": "length", "length": 0}
                self._deliver([seq])
                continue
            self._running.append(seq)

    def _attach_cache(self, seq: Sequence) -> None:
        key = seq.cache_key()
        hit = self.prefix_cache.lookup(key) if self.config.prefix_cache_tokens else None
        if hit is None:
            seq.cache = self.model.new_cache()
        else:
            seq.cache, seq.cached_tokens = hit
        images = seq.request.images
        if images is not None:  # encoded by the weights the cache is computed with
            with torch.inference_mode():
                embeds = self.model.encode_images(images.pixels)
            seq.images = place_images(images.spans, embeds, images.digests)

    def _plan(self, batch: list[Sequence]) -> tuple[list[Sequence], list[list[int]], list[bool]]:
        """Which tokens each sequence computes this step: decodes always, prompt chunks
        within the prefill budget (a long prompt spreads over several steps)."""
        budget = self.config.max_prefill_tokens
        seqs, chunks, completes = [], [], []
        for seq in sorted(batch, key=lambda s: s.cache is not None and len(s.pending()) > 1):
            if seq.cache is None:
                self._attach_cache(seq)
            pending = seq.pending()
            if len(pending) > 1:
                if budget <= 0:
                    continue
                take = pending[:budget]
                budget -= len(take)
            else:
                take = pending
            seqs.append(seq)
            chunks.append(take)
            completes.append(len(take) == len(pending))
        return seqs, chunks, completes

    def _step_safely(self, batch: list[Sequence]) -> None:
        try:
            self._step(batch)
        except Exception as exc:  # a failed step must not kill the server
            log.exception("engine step failed")
            with self._cv:
                for seq in batch:
                    seq.abort(f"engine error: {exc}")
                self._retire(batch)

    def _step(self, batch: list[Sequence]) -> None:
        seqs, chunks, completes = self._plan(batch)
        if not seqs:
            return
        logits = self.model.forward(
            chunks, [s.cache for s in seqs], images=[s.images for s in seqs]
        )
        sampling = [s for s, done in zip(seqs, completes, strict=True) if done]
        if sampling:
            rows = torch.stack([lg for lg, done in zip(logits, completes, strict=True) if done])
            forced = [s.forced_token() for s in sampling]
            uniforms = [s.rng.random() for s in sampling]
            banned = [
                banned_ids(s.params, len(s.output_ids), self.eos_ids) + self.never_sample
                for s in sampling
            ]
            params = [s.params for s in sampling]
            tokens, logprobs = choose_tokens(rows, params, uniforms, forced, banned)
            for seq, token, logprob in zip(sampling, tokens, logprobs, strict=True):
                seq.append(token, logprob, self.version)
                seq.update_finish(self.decode, self.eos_ids, self.context_limit)
        with self._cv:
            self.steps += 1
            self.generated_tokens += len(sampling)
            self._retire([s for s in sampling if s.finish is not None])

    def _retire(self, done: list[Sequence]) -> None:
        for seq in done:
            if seq in self._running:
                self._running.remove(seq)
            if seq.cache is not None and seq.finish.get("type") != "abort":
                self.prefix_cache.insert(seq.cache_key()[: seq.cache.length], seq.cache)
        self._deliver(done)

    def _deliver(self, done: list[Sequence]) -> None:
        for seq in done:
            seq.on_done(seq.result(self.decode, self.version, self._routed_experts(seq)))

    def _routed_experts(self, seq: Sequence) -> torch.Tensor | None:
        """The rows a request asked for: its cache's, for positions [0, prompt + output - 1);
        None when the cache does not hold them all (it ended before computing them: an
        abort, a request for no tokens), as clients take every row or none. A view: the
        cache is never written once retired."""
        if not seq.request.return_routed_experts or seq.cache is None:
            return None
        rows = seq.cache.routed()
        want = len(seq.request.prompt_ids) + len(seq.output_ids) - 1
        return rows[:want] if rows is not None and rows.shape[0] >= want else None

    def _abort(self, rid: str | None, message: str) -> int:
        victims = [
            s for s in [*self._running, *self._waiting] if rid is None or s.request.rid == rid
        ]
        for seq in victims:
            seq.abort(message)
            if seq in self._waiting:
                self._waiting.remove(seq)
        self._retire(victims)
        return len(victims)

    def _pause(self, mode: str) -> None:
        if mode == "abort":
            self._abort(None, "aborted by pause_generation")
        elif mode == "retract":
            for seq in reversed(self._running):
                seq.cache = None
                self._waiting.appendleft(seq)
            self._running.clear()
        self.paused = mode

    def _resume(self) -> None:
        self.paused = None

    def _flush(self) -> bool:
        if self._running or self._waiting:
            return False
        self.prefix_cache.clear()
        return True

    def _maybe_swap(self) -> None:
        if self._swap is None or (self._running and not self.paused):
            return
        model, version, future = self._swap
        self._swap = None
        self.model = model
        self.version = version or _next_version(self.version)
        self.prefix_cache.clear()
        carried = [*self._running, *self._waiting]
        for seq in carried:
            seq.cache = None  # paused requests recompute under the new weights
        future.set_result((self.version, len(carried) if self.paused else 0))


def _resolve(future: Future, value: object) -> None:
    if not future.done():  # a caller may have cancelled (client went away)
        future.set_result(value)


def _next_version(version: str) -> str:
    return str(int(version) + 1) if version.isdigit() else f"{version}+1"
