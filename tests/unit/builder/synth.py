"""Synthetic token-level sessions in a ChatML-like template, for builder tests and benches.

Token ids: 1 <|im_start|>, 2 <|im_end|> (the end-of-turn), 3 newline, 4-7 roles
(system, user, assistant, tool); content tokens are 100..999. A message renders as
``[1, role, 3] + content + [2, 3]``; the generation prompt is ``[1, 6, 3]``. Prompts are
built the way a token-mode proxy builds them: previous prompt + sampled output + glue.
"""

from __future__ import annotations

import random

from schemas import CompletionRecord, Protocol, UpstreamMode
from schemas.completion import delta_encode

IM_START, EOT, NL = 1, 2, 3
ROLE = {"system": 4, "user": 5, "assistant": 6, "tool": 7}
GEN = [IM_START, ROLE["assistant"], NL]


def msg(role: str, content: list[int]) -> list[int]:
    return [IM_START, ROLE[role], NL, *content, EOT, NL]


def text(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 1000) for _ in range(n)]


def opening(system: list[int], user: list[int]) -> list[int]:
    return msg("system", system) + msg("user", user) + GEN


def glue_after(output: list[int], tool_result: list[int]) -> list[int]:
    """What the next prompt adds after ``output``: close the turn, a tool result, gen."""
    close = [] if output[-1:] == [EOT] else [EOT]
    return [*close, NL, *msg("tool", tool_result), *GEN]


class Capture:
    """Records calls as the proxy would: seq order, optional delta-encoded prompts."""

    def __init__(self, session_id: str = "s-1", *, delta: bool = True, mode=UpstreamMode.TOKEN):
        self.session_id, self.delta, self.mode = session_id, delta, mode
        self.records: list[CompletionRecord] = []
        self._prev: tuple[int, list[int]] | None = None

    def call(
        self,
        prompt: list[int],
        output: list[int],
        *,
        finish: str = "tool_calls",
        weight_version: str | None = "v1",
        logprobs: bool = True,
        **fields,
    ) -> CompletionRecord:
        seq = len(self.records)
        base, base_len, tail = delta_encode(prompt, self._prev) if self.delta else (None, 0, prompt)
        rec = CompletionRecord(
            session_id=self.session_id,
            seq=seq,
            protocol=Protocol.OPENAI_CHAT,
            mode=self.mode,
            model="m",
            prompt_ids=list(tail),
            prompt_base_seq=base,
            prompt_base_len=base_len,
            output_ids=list(output),
            output_logprobs=[-0.01 * (i % 7 + 1) for i in range(len(output))] if logprobs else [],
            finish_reason=finish,
            weight_version=weight_version,
            **fields,
        )
        self.records.append(rec)
        self._prev = (seq, prompt + output)
        return rec


def agent_loop(
    cap: Capture,
    rng: random.Random,
    turns: int,
    *,
    system: list[int] | None = None,
    user: list[int] | None = None,
    out_len: tuple[int, int] = (5, 40),
    tool_len: tuple[int, int] = (5, 80),
    length_every: int = 0,
) -> tuple[list[int], list[int]]:
    """``turns`` calls of a tool-using loop; returns the last (prompt, output)."""
    prompt = opening(system or text(rng, 30), user or text(rng, 20))
    output: list[int] = []
    for t in range(turns):
        last = t == turns - 1
        truncated = length_every and (t + 1) % length_every == 0 and not last
        output = text(rng, rng.randint(*out_len)) + ([] if truncated else [EOT])
        finish = "length" if truncated else ("stop" if last else "tool_calls")
        cap.call(prompt, output, finish=finish)
        if not last:
            prompt = prompt + output + glue_after(output, text(rng, rng.randint(*tool_len)))
    return prompt, output
