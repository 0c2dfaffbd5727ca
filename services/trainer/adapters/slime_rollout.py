"""slime's custom rollout function backed by Polar (fully asynchronous, with a prefetch
window).

    --rollout-function-path services.trainer.adapters.slime_rollout.generate_rollout

slime calls ``generate_rollout(args, rollout_id, data_source, evaluation=False)`` and
trains on the ``list[list[Sample]]`` (one list per group) it returns, in a
``RolloutFnTrainOutput(samples, metrics)``. Here each prompt group slime's data source
hands out (``data_source.get_samples(1)``: a list of ``n_samples_per_prompt`` Samples
sharing one prompt) becomes one Polar task of ``n_samples_per_prompt`` harness sessions.
``prefetch`` groups are kept in flight beyond the ones a rollout needs, so the next
rollout's sessions run while slime trains (fully-async training; the weights a sample
was drawn with are in its ``weight_versions``, for slime's off-policy corrections).

Each session becomes one Sample (its main trace: the trainable, non-side-call trace
with the most sampled tokens), so a group keeps exactly ``n_samples_per_prompt`` samples
as slime's GRPO reward normalization expects: ``tokens`` (prompt + response ids),
``response_length``, ``loss_mask`` (1 on sampled tokens, 0 on tool results and template
glue), ``rollout_log_probs`` (the engine's; 0.0 on masked tokens), ``reward``,
``weight_versions``, ``status``, ``group_index``/``index``, ``session_id`` and, in
``metadata``, the Polar ids and version spans. A session that sampled nothing (it
failed before its first model call) is a one-token, fully masked Sample with status
``failed`` and reward 0, which still counts in its group's baseline.

A session whose tool calls did not parse is handled by the rule Polar's trainer uses
(``services/trainer/toolparse.py``: ``zero_reward`` by default, or ``mask``, ``keep``);
``metadata`` says how many failed (``polar_tool_parse_failures``).

Config, read from slime's ``args`` (add them with slime's custom-argument hook) or the
environment: ``polar_nats_url`` / ``POLAR_NATS_URL`` (else ``$POLAR_ENV_FILE``'s, the file
``polar up`` writes: ``services.client.connection``), ``polar_task_template`` /
``POLAR_TASK_TEMPLATE`` (a TaskRequest JSON or YAML file without ``instruction``),
``polar_prefetch`` / ``POLAR_PREFETCH`` (default: ``rollout_batch_size``),
``polar_tool_parse_failures`` / ``POLAR_TOOL_PARSE_FAILURES`` (default ``zero_reward``).

slime is not installable here: the Sample fields above are slime's documented ones
(``slime/utils/types.py``, ``slime/rollout/base_types.py``) and the tests check this
module against them, not against slime itself.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from schemas import Outcome, Trace, Trajectory
from schemas.routing import routing_array
from services.client import Group
from services.trainer.adapters.rollouts import PolarRollouts, RolloutError
from services.trainer.adapters.trl_grpo import main_trace
from services.trainer.toolparse import DEFAULT_RULE, apply_rule, check_rule, tool_failures

SLIME_STATUS = {  # Polar outcome -> slime Sample.Status value
    Outcome.COMPLETED: "completed",
    Outcome.TIMEOUT: "truncated",
    Outcome.ERROR: "failed",
    Outcome.CANCELLED: "aborted",
}


def sample_fields(
    t: Trajectory,
    group_index: int,
    index: int,
    pad_id: int = 0,
    tool_parse_failures: str = DEFAULT_RULE,
    routing: Mapping[str, bytes] | None = None,
) -> dict:
    """The slime Sample fields of one session (keyword arguments of ``Sample``; ``status``
    as its value: ``Sample.Status(fields["status"])``), ``tool_parse_failures`` applied.
    ``routing``: the rows its trace's MoE routing names (``PolarRollouts.routing``), for
    ``rollout_routed_experts``."""
    t = apply_rule(t, tool_parse_failures)
    trace = main_trace(t)
    meta = {
        "polar_session_id": t.session_id,
        "polar_task_id": t.task_id,
        "polar_attempt": t.attempt,
        "polar_outcome": str(t.outcome),
        "polar_eval_status": t.eval_status,
        "polar_tool_parse_failures": tool_failures(t),
    }
    reward = t.reward if t.reward is not None else 0.0
    if trace is None:
        return {
            "group_index": group_index,
            "index": index,
            "tokens": [pad_id],
            "response_length": 1,
            "loss_mask": [0],
            "rollout_log_probs": [0.0],
            "reward": reward,
            "weight_versions": [],
            "status": "failed",
            "session_id": t.session_id,
            "metadata": meta,
        }
    meta["polar_trace_id"] = trace.trace_id
    meta["polar_version_spans"] = [[s.version, s.start, s.end] for s in trace.version_spans]
    routed = {}
    if trace.routing is not None and routing is not None:
        routed = {"rollout_routed_experts": slime_routing(trace, routing)}
        meta["polar_routing_positions"] = trace.routing.covered
    return {
        "group_index": group_index,
        "index": index,
        "tokens": [*trace.prompt_ids, *trace.response_ids],
        "response_length": len(trace.response_ids),
        "loss_mask": list(trace.loss_mask),
        "rollout_log_probs": [0.0 if lp is None else lp for lp in trace.response_logprobs],
        "reward": reward,
        "weight_versions": list(trace.weight_versions),
        "status": SLIME_STATUS.get(t.outcome, "completed"),
        "session_id": t.session_id,
        "metadata": meta,
        **routed,
    }


def slime_routing(trace: Trace, routing: Mapping[str, bytes]):
    """slime's ``rollout_routed_experts``: int32 ``[len(tokens) - 1, layers, top_k]``, the
    row of every token but the last (-1 where Polar has none: slime replays the rest)."""
    n = len(trace.prompt_ids) + len(trace.response_ids)
    assert trace.routing is not None
    experts, _ = routing_array(trace.routing, n, routing)
    return experts[: n - 1]


def group_samples(
    group: Group,
    slime_group: list,
    sample_cls: Any,
    tool_parse_failures: str = DEFAULT_RULE,
    routing: Mapping[str, bytes] | None = None,
) -> list:
    """slime's group (its prompt's Samples) filled from Polar's: one Sample per session, in
    sample order, keeping the prompt, label and metadata slime gave. A short group keeps
    only the sessions that came back."""
    members = sorted(group.trajectories, key=lambda t: t.metadata.get("sample_index", 0))
    out = []
    for i, t in enumerate(members):
        template = slime_group[i] if i < len(slime_group) else slime_group[0]
        index = _index(template, i)
        fields = sample_fields(t, template.group_index, index, 0, tool_parse_failures, routing)
        fields["status"] = sample_cls.Status(fields["status"])
        fields["metadata"] = {**(template.metadata or {}), **fields["metadata"]}
        out.append(sample_cls(prompt=template.prompt, label=template.label, **fields))
    return out


def _index(template: Any, i: int) -> int:
    return template.index if template.index is not None else i


def _setting(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, None)
    return value if value is not None else os.environ.get(name.upper(), default)


def load_template(path: str | Path) -> dict[str, Any]:
    raw = Path(path).read_bytes()
    if str(path).endswith((".yaml", ".yml")):
        import yaml

        return yaml.safe_load(raw)
    return orjson.loads(raw)


@dataclass
class InFlight:
    task_id: str
    slime_group: list  # the Samples slime handed out for this prompt


class SlimeRollout:
    """The prefetch window: groups submitted ahead, handed to slime in submission order."""

    def __init__(
        self,
        rollouts: PolarRollouts,
        prefetch: int,
        sample_cls: Any,
        tool_parse_failures: str = DEFAULT_RULE,
    ) -> None:
        self.rollouts, self.prefetch, self.sample_cls = rollouts, prefetch, sample_cls
        self.tool_parse_failures = check_rule(tool_parse_failures)
        self.in_flight: deque[InFlight] = deque()

    def top_up(self, data_source: Any, want: int) -> None:
        """Keep ``want + prefetch`` groups in flight (while the data source has prompts)."""
        while len(self.in_flight) < want + self.prefetch:
            got = data_source.get_samples(1)
            if not got:
                return
            for slime_group in got:
                prompt = slime_group[0].prompt
                [task_id] = self.rollouts.submit([prompt], len(slime_group))
                self.in_flight.append(InFlight(task_id, slime_group))

    def rollout(self, data_source: Any, batch_size: int) -> list[list]:
        """``batch_size`` groups as slime Samples; the prefetched ones keep running."""
        self.top_up(data_source, batch_size)
        taken = [self.in_flight.popleft() for _ in range(min(batch_size, len(self.in_flight)))]
        if not taken:
            raise RolloutError("the data source gave no prompts")
        groups = self.rollouts.collect([f.task_id for f in taken])
        self.rollouts.commit_pending()  # slime owns them now (its own buffer)
        self.top_up(data_source, 0)  # refill the window while slime trains
        routing = self.rollouts.routing(groups)  # MoE: the rows slime replays (R3)
        return [
            group_samples(g, f.slime_group, self.sample_cls, self.tool_parse_failures, routing)
            for g, f in zip(groups, taken, strict=True)
        ]


_rollout: SlimeRollout | None = None


def _slime_types() -> tuple[Any, Any]:
    from slime.rollout.base_types import RolloutFnTrainOutput
    from slime.utils.types import Sample

    return Sample, RolloutFnTrainOutput


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False):
    """slime's ``--rollout-function-path`` entry point."""
    if evaluation:
        raise RolloutError("evaluation rollouts: submit the eval set as Polar tasks instead")
    global _rollout
    sample_cls, output_cls = _slime_types()
    if _rollout is None:
        nats_url = _setting(args, "polar_nats_url")  # None: $POLAR_ENV_FILE's, or the default
        template_path = _setting(args, "polar_task_template")
        if not template_path:
            raise RolloutError("set polar_task_template (or $POLAR_TASK_TEMPLATE): a task file")
        rule = check_rule(str(_setting(args, "polar_tool_parse_failures", DEFAULT_RULE)))
        rollouts = PolarRollouts(nats_url, load_template(template_path)).start()
        prefetch = int(_setting(args, "polar_prefetch", args.rollout_batch_size))
        _rollout = SlimeRollout(rollouts, prefetch, sample_cls, rule)
    samples = _rollout.rollout(data_source, args.rollout_batch_size)
    return output_cls(samples=samples, metrics={"polar/in_flight": len(_rollout.in_flight)})
