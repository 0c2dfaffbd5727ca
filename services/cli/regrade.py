"""``polar regrade``: stored sessions evaluated again with another evaluator or config.

The stored trajectories (``polar.trajectories.>``) are read back: the sessions and tasks
named, or all, within ``--since``/``--until``. Each is evaluated with the evaluator named
on the command line (or in a file) from its recorded artifacts, or, when that evaluator
needs a runtime, by replaying the session into a fresh one (``polar replay`` with the new
evaluator: no engine). The re-graded trajectories, the same tokens with both grades
(``Trajectory.grades``), are stored on ``polar.regrades.<regrade_id>.<task>``;
``polar export --regrade ID`` exports them.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import msgspec
import orjson
import yaml

from evaluators import EvalResult
from schemas import EvaluatorSpec, SessionResult, TaskRequest, Trajectory

AGO = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


class RegradeUsage(ValueError):
    """A command-line value the re-grade cannot use: said as it was given."""


def parse_when(text: str | None, now: datetime | None = None) -> datetime | None:
    """An ISO 8601 time (UTC unless it says) or an age (``90m``, ``24h``, ``7d``: that
    long before ``now``)."""
    if text is None:
        return None
    if m := AGO.match(text.strip()):
        now = now or datetime.now(UTC)
        return now - timedelta(**{UNITS[m.group(2)]: float(m.group(1))})
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise RegradeUsage(f"{text!r} is neither an ISO 8601 time nor an age like 24h") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def evaluator_spec(name: str | None, config: str | None, file: Path | None) -> EvaluatorSpec:
    """The evaluator to re-grade with: ``--evaluator NAME [--config JSON]``, or a file
    holding an evaluator spec (YAML or JSON, the task file's ``evaluator`` section)."""
    if (name is None) == (file is None):
        raise RegradeUsage("name the evaluator: --evaluator NAME or --evaluator-file FILE")
    if file is not None:
        if config is not None:
            raise RegradeUsage("--config goes with --evaluator; a file holds its own config")
        try:
            raw = yaml.safe_load(file.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise RegradeUsage(f"cannot read {file}: {exc}") from None
        raw = raw.get("evaluator", raw) if isinstance(raw, dict) else raw
    else:
        try:
            cfg = orjson.loads(config) if config else {}
        except orjson.JSONDecodeError as exc:
            raise RegradeUsage(f"--config is not JSON: {exc}") from None
        raw = {"name": name, "config": cfg}
    try:
        return msgspec.convert(raw, EvaluatorSpec)
    except msgspec.ValidationError as exc:
        raise RegradeUsage(f"not an evaluator spec: {exc}") from None


def replay_result(session: SessionResult, diverged: str | None) -> EvalResult:
    """The verdict a replay gave a session: its reward, unless the replay diverged (the
    harness did not redo the recorded work) or its evaluation failed."""
    if diverged:
        return EvalResult.error(f"the replay diverged: {diverged}")
    if session.reward is None:
        why = session.eval_reason or session.reason or f"the replay ended {session.state}"
        return EvalResult.error(why)
    return EvalResult.ok(session.reward, session.eval_reason)


def with_evaluator(task: TaskRequest, spec: EvaluatorSpec) -> TaskRequest:
    """The recorded task, graded by ``spec`` (in a fresh runtime unless it says live)."""
    return msgspec.structs.replace(task, evaluator=spec)


def result_line(t: Trajectory, scored: Trajectory) -> str:
    state = "" if scored.eval_status == "ok" else f" ({scored.eval_reason})"
    return f"{t.session_id}: reward {t.reward} -> {scored.reward}{state}"
