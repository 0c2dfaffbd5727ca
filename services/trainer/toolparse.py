"""What training does with a session whose tool calls did not parse (``Trace.tool_parse``).

One rule, ``tool_parse_failures`` in the trainer's config (and the adapters' argument):

- ``zero_reward`` (default): the session's reward is 0, as the reference RL systems do
  with a rollout whose tool calls did not parse: against its group, a broken call is a
  failure whatever the evaluator found. Where traces carry their own rewards (the
  trainer's per-trace grouping), only the traces with a failure get 0.
- ``mask``: the loss mask is 0 on each failed call's tokens, on the whole trace where the
  failure has no span (an unknown tool, bad arguments); the reward is kept.
- ``keep``: trained on as delivered.

Any trace counts, side calls too. Plain functions of schema structs: no I/O.
"""

from __future__ import annotations

from typing import Literal, get_args

import msgspec

from schemas import Trace, Trajectory

ToolParseRule = Literal["keep", "zero_reward", "mask"]
RULES: tuple[str, ...] = get_args(ToolParseRule)
DEFAULT_RULE: ToolParseRule = "zero_reward"


def check_rule(rule: str) -> str:
    if rule not in RULES:
        raise ValueError(f"tool_parse_failures must be one of {', '.join(RULES)}, not {rule!r}")
    return rule


def failures_of(tr: Trace) -> int:
    return tr.tool_parse.failed if tr.tool_parse is not None else 0


def tool_failures(t: Trajectory) -> int:
    """Tool calls of the session that did not parse or check."""
    return sum(failures_of(tr) for tr in t.traces)


def apply_rule(t: Trajectory, rule: str, *, per_trace: bool = False) -> Trajectory:
    """``t`` as ``rule`` trains it. ``per_trace``: its traces' own rewards are what is
    compared (the trainer's per-trace grouping), so ``zero_reward`` zeroes those of the
    traces with a failure; otherwise the session's reward (and its copies on the traces)."""
    if check_rule(rule) == "keep" or not tool_failures(t):
        return t
    if rule == "mask":
        return msgspec.structs.replace(t, traces=[masked(tr) for tr in t.traces])
    if per_trace:
        traces = [_zeroed(tr) if failures_of(tr) else tr for tr in t.traces]
        return msgspec.structs.replace(t, traces=traces)
    return msgspec.structs.replace(
        t,
        reward=None if t.reward is None else 0.0,  # not evaluated stays so (left out)
        traces=[tr if tr.reward is None else _zeroed(tr) for tr in t.traces],
    )


def _zeroed(tr: Trace) -> Trace:
    return msgspec.structs.replace(tr, reward=0.0)


def masked(tr: Trace) -> Trace:
    """``tr`` with loss mask 0 on its failed calls' spans (all of it for a failure with
    none)."""
    if not failures_of(tr):
        return tr
    mask = list(tr.loss_mask)
    for f in tr.tool_parse.failures:  # type: ignore[union-attr]  # failures_of: not None
        if f.start < 0:
            mask = [0] * len(mask)
            break
        mask[f.start : f.end] = [0] * len(mask[f.start : f.end])
    return msgspec.structs.replace(tr, loss_mask=mask, trainable=tr.trainable and any(mask))
