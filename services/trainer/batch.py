"""From scored groups to training samples (plain functions, no I/O).

Grouping rule (which rewards are compared for the advantage):

- ``session``: a session's reward applies to every trainable trace of that session; the
  group is the task's sessions.
- ``trace``: each trace carries its own reward (one question per trace); the group for
  the advantage is (task, trace index) across the task's sessions — trace i of every
  session is compared with trace i of the others.
- ``prompt``: like ``trace``, but the group is (task, prompt ids): traces that saw the same
  prompt are compared whatever their position, for agents that ask several questions
  concurrently (their traces' order differs from session to session).
- ``auto`` (default): ``trace`` when a member says so (``metadata.per_trace_rewards``) or
  its traces' rewards differ from its session reward, else ``session``.

Members that cannot be compared are counted and handled by one rule, never silently
dropped: a member whose evaluation failed (``eval_status != ok`` or no reward:
``errored``) or that has no trainable token (``empty``) is left out of the group's
normalization and contributes no loss; a group missing members (handed out partial:
``missing``) is normalized over the members it has; a group left with fewer than two
comparable members gets advantage 0 (``degenerate``). Trainable traces are those the
builder marked ``trainable`` with at least one loss token; side calls (titles, probes)
are not trained on.

Tool calls that did not parse are handled by ``tool_parse`` (``toolparse.apply_rule``)
once the grouping is decided, so a reward it zeroes never changes the grouping; the
members with such calls are counted (``tool_parse_failed``) whatever the rule.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from schemas import ImageSpan, Trajectory
from schemas.trajectory import Trace
from services.trainer.objective import advantages
from services.trainer.toolparse import apply_rule, tool_failures


@dataclass(frozen=True)
class Sample:
    task_id: str
    session_id: str
    trace_index: int
    tokens: list[int]  # prompt + response
    prompt_len: int
    mask: list[int]  # over the response
    behavior: list[float]  # captured logprob per response token (0.0 where mask is 0)
    versions: tuple[str, ...]
    reward: float
    advantage: float
    images: tuple[ImageSpan, ...] = ()  # where the images the model read sit in tokens

    @property
    def loss_tokens(self) -> int:
        return sum(self.mask)


@dataclass
class GroupCounts:
    groups: int = 0
    members: int = 0
    missing: int = 0  # expected members not delivered (partial groups)
    errored: int = 0
    empty: int = 0
    degenerate: int = 0  # advantage groups with < 2 comparable members
    zero_variance: int = 0  # advantage groups whose rewards were all equal
    per_trace_groups: int = 0  # tasks grouped by trace index
    tool_parse_failed: int = 0  # members with a tool call that did not parse
    rewards: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, int]:
        return {k: v for k, v in vars(self).items() if k != "rewards"}


def trainable_traces(t: Trajectory) -> list[Trace]:
    return [tr for tr in t.traces if tr.trainable and tr.side_call is None and any(tr.loss_mask)]


def usable(t: Trajectory) -> bool:
    return t.eval_status == "ok" and t.reward is not None


def per_trace(members: list[Trajectory], grouping: str) -> bool:
    if grouping != "auto":
        return grouping in ("trace", "prompt")
    for t in members:
        if t.metadata.get("per_trace_rewards") is True:
            return True
        if any(tr.reward is not None and tr.reward != t.reward for tr in trainable_traces(t)):
            return True
    return False


def _sample(t: Trajectory, index: int, tr: Trace, reward: float, adv: float) -> Sample:
    return Sample(
        task_id=t.task_id,
        session_id=t.session_id,
        trace_index=index,
        tokens=[*tr.prompt_ids, *tr.response_ids],
        prompt_len=len(tr.prompt_ids),
        mask=list(tr.loss_mask),
        behavior=[
            (lp if m and lp is not None else 0.0)
            for lp, m in zip(tr.response_logprobs, tr.loss_mask, strict=True)
        ],
        versions=tuple(tr.weight_versions),
        reward=reward,
        advantage=adv,
        images=tuple(tr.images),
    )


def _scored(rewards: list[float], objective: str, counts: GroupCounts) -> list[float]:
    if len(rewards) < 2:
        counts.degenerate += 1
    elif len(set(rewards)) == 1:
        counts.zero_variance += 1
    return advantages(rewards, objective)


def group_samples(
    members: list[Trajectory],
    expected: int | None,
    objective: str,
    grouping: str,
    counts: GroupCounts,
    tool_parse: str = "keep",
) -> list[Sample]:
    """One task's delivered members -> its samples with advantages; ``counts`` updated.
    ``tool_parse``: the rule for members whose tool calls did not parse."""
    counts.groups += 1
    counts.members += len(members)
    counts.missing += max(0, (expected or len(members)) - len(members))
    by_trace = per_trace(members, grouping)  # decided on the rewards as evaluated
    counts.tool_parse_failed += sum(1 for t in members if tool_failures(t))
    members = [apply_rule(t, tool_parse, per_trace=by_trace) for t in members]
    comparable = []
    for t in members:
        if not usable(t):
            counts.errored += 1
        elif not trainable_traces(t):
            counts.empty += 1
        else:
            comparable.append(t)
    counts.rewards.extend(float(t.reward) for t in comparable)
    if not by_trace:
        advs = _scored([float(t.reward) for t in comparable], objective, counts)
        return [
            _sample(t, i, tr, float(t.reward), a)
            for t, a in zip(comparable, advs, strict=True)
            for i, tr in enumerate(trainable_traces(t))
        ]
    counts.per_trace_groups += 1
    by_key: dict[object, list[tuple[Trajectory, int, Trace, float]]] = {}
    for t in comparable:
        for i, tr in enumerate(trainable_traces(t)):
            reward = tr.reward if tr.reward is not None else t.reward  # unscored: the session's
            # the same prompt ids with other images are another question
            key = (tuple(tr.prompt_ids), _digests(tr)) if grouping == "prompt" else i
            by_key.setdefault(key, []).append((t, i, tr, float(reward)))
    out = []
    for entries in by_key.values():
        advs = _scored([r for *_, r in entries], objective, counts)
        out += [_sample(t, i, tr, r, a) for (t, i, tr, r), a in zip(entries, advs, strict=True)]
    return out


def _digests(tr: Trace) -> tuple[tuple[int, str], ...]:
    return tuple((im.start, im.digest) for im in tr.images)


def image_digests(samples: list[Sample]) -> set[str]:
    """Every image the samples' tokens hold (what the policy needs the pixels of)."""
    return {im.digest for s in samples for im in s.images}


def staleness_histogram(ages: list[int | None]) -> dict[str, int]:
    c = Counter("unknown" if a is None else str(a) for a in ages)
    return dict(sorted(c.items()))
