"""Export layouts: trajectories -> rows (pure functions).

``sft``: a supervised corpus from the sessions that passed their evaluator
(``eval_status == "ok"`` and ``reward >= min_reward``): per trainable trace, the chat
``messages`` plus ``tokens`` (prompt + response ids) and ``loss_mask`` over all of them
(1 only on tokens the model sampled).

``slime``: one Slime ``Sample`` per trainable trace of every scored trajectory:
``tokens`` (prompt + response ids), ``response_length``, ``loss_mask`` and
``rollout_log_probs`` over the response, ``reward``, ``rollout_id``, ``status``.

Group ids stay consistent when a session has several traces: every trace of every
session of a task has the same ``group_id`` (the task id) and ``group_index`` (slime's
int, numbered per export in the order tasks first appear), since a session's reward
(and so its advantage) applies to each of its traces. ``sample_index`` is the session's
place in its group, ``trace_index`` the trace's place in its session (per-trace rewards
group by ``(group_id, trace_index)``), and ``index`` numbers rows uniquely.

A trace that holds images adds ``images`` to its row (sft: at the top, slime: in
``metadata``): ``[digest, start, length]`` per image, positions in ``tokens``; the bytes
are in the object store under ``subjects.image_object(digest)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from schemas import Outcome, Trace, Trajectory

Row = dict[str, Any]
SLIME_STATUS = {
    Outcome.COMPLETED: "completed",
    Outcome.TIMEOUT: "truncated",
    Outcome.ERROR: "failed",
    Outcome.CANCELLED: "aborted",
}


@dataclass
class Numbering:
    """slime's int ids across one export: a group index per task, a running row index."""

    groups: dict[str, int] = field(default_factory=dict)
    rows: int = 0

    def group(self, task_id: str) -> int:
        return self.groups.setdefault(task_id, len(self.groups))

    def row(self) -> int:
        self.rows += 1
        return self.rows - 1


def _trainable(trace: Trace) -> bool:
    return trace.trainable and any(trace.loss_mask)


def passed(t: Trajectory, min_reward: float) -> bool:
    return t.eval_status == "ok" and t.reward is not None and t.reward >= min_reward


def sft_rows(
    t: Trajectory, min_reward: float = 1.0, numbering: Numbering | None = None
) -> list[Row]:
    """``numbering`` is unused: SFT rows carry no slime ids."""
    if not passed(t, min_reward):
        return []
    return [
        {
            "session_id": t.session_id,
            "task_id": t.task_id,
            "attempt": t.attempt,
            "trace_id": tr.trace_id,
            "reward": t.reward,
            "messages": tr.messages,
            "tools": tr.tools,
            "tokens": [*tr.prompt_ids, *tr.response_ids],
            "loss_mask": [0] * len(tr.prompt_ids) + list(tr.loss_mask),
            "prompt_length": len(tr.prompt_ids),
            **_images(tr),
        }
        for tr in t.traces
        if _trainable(tr)
    ]


def slime_rows(
    t: Trajectory, min_reward: float | None = None, numbering: Numbering | None = None
) -> list[Row]:
    """Every scored trajectory (``min_reward`` filters, if given); an evaluation that
    failed has no reward and is left out. ``numbering`` is shared across one export."""
    if t.eval_status != "ok" or t.reward is None:
        return []
    if min_reward is not None and t.reward < min_reward:
        return []
    numbering = numbering if numbering is not None else Numbering()
    index = t.metadata.get("sample_index")
    return [
        {
            "rollout_id": f"{t.session_id}:{t.attempt}:{tr.trace_id}",
            "group_id": t.task_id,
            "group_index": numbering.group(t.task_id),
            "index": numbering.row(),
            "sample_index": index if isinstance(index, int) else None,
            "trace_index": position,
            "tokens": [*tr.prompt_ids, *tr.response_ids],
            "response_length": len(tr.response_ids),
            "loss_mask": list(tr.loss_mask),
            # masked positions (tool output, template glue) have no logprob: 0.0, unused
            "rollout_log_probs": [0.0 if lp is None else lp for lp in tr.response_logprobs],
            "reward": t.reward if tr.reward is None else tr.reward,
            "status": SLIME_STATUS.get(t.outcome, "completed"),
            "weight_versions": list(tr.weight_versions),
            "session_id": t.session_id,
            "metadata": {
                "chain_id": tr.chain_id,
                "break_reason": tr.break_reason,
                "builder": t.builder,
                "version_spans": [[s.version, s.start, s.end] for s in tr.version_spans],
                **_images(tr),
            },
            **_routing(t, tr),
        }
        for position, tr in enumerate(t.traces)
        if _trainable(tr)
    ]


def routing_file(session_id: str, attempt: int, trace_id: str) -> str:
    """Where a slime row's MoE routing goes, relative to the export file's folder: an
    ``.npy`` of int32 ``[len(tokens) - 1, layers, top_k]`` (``export`` writes it)."""
    name = f"{session_id}-{attempt}-{trace_id}".replace("/", "-")
    return f"{ROUTING_DIR}/{name}.npy"


ROUTING_DIR = "routed_experts"


def _routing(t: Trajectory, tr: Trace) -> dict[str, str]:
    if tr.routing is None:
        return {}
    return {"rollout_routed_experts": routing_file(t.session_id, t.attempt, tr.trace_id)}


def _images(tr: Trace) -> dict[str, list]:
    """The trace's images, when it has any (text rows keep their columns)."""
    return {"images": [[i.digest, i.start, i.length] for i in tr.images]} if tr.images else {}


LAYOUTS: dict[str, Callable[..., list[Row]]] = {"sft": sft_rows, "slime": slime_rows}
