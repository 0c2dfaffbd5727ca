"""docs/reference/trajectory.md: what a trainer and a client receive — a Trajectory with
its Traces (``schemas/trajectory.py``), a task's TaskResult (``schemas/result.py``) and
the CompletionRecord of each model call the traces are built from
(``schemas/completion.py``) — every field, from the code."""

from __future__ import annotations

import schemas.completion as completion_module
import schemas.trajectory as trajectory_module
from infra.docgen.source import markdown
from infra.docgen.structs import Page, section, undocumented, walk
from schemas.completion import CompletionRecord
from schemas.result import TaskResult
from schemas.trajectory import Trajectory

ROOTS = (Trajectory, TaskResult, CompletionRecord)
PAGE = Page()


def structs():
    return walk(ROOTS)


def undocumented_fields() -> list[str]:
    return undocumented(structs())


def render() -> str:
    parts = [
        "# Trajectories, results and completion records",
        "",
        markdown(trajectory_module.__doc__ or "").strip(),
        "",
        "A task's end is a [TaskResult](#taskresult) on `polar.tasks.<task_id>.result` (and"
        " its `callback_url`); each model call is a [CompletionRecord](#completionrecord)"
        " on `polar.completions.<session_id>`, which the builder turns into the"
        " trajectory's traces. See [the subjects](subjects.md) for where each travels and"
        " docs/training.md for how a trainer reads them.",
        "",
        *(section(t, PAGE) + "\n" for t in structs()),
        "## About completion records",
        "",
        markdown(completion_module.__doc__ or "").strip(),
    ]
    return "\n".join(parts)
