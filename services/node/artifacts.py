"""Collecting what a harness left behind, before its runtime is released."""

from __future__ import annotations

import io
import shlex
import tarfile

import orjson

from evaluators.registry import may_read_workspace
from schemas import TaskRequest
from services.node.harnesses.base import Harness, HarnessContext

GIT = "git -c user.name=polar -c user.email=polar@localhost -c core.hooksPath=/dev/null"


def takes_diff(spec: TaskRequest) -> bool:
    """Whether a session of this task gets a diff: a git baseline of the prepared workdir in
    INIT and ``git diff`` after the run (~15 ms of git per session). ``agent.collect_diff``
    decides when set; by default the diff is taken only when the evaluator may read the
    workspace, since nothing else needs it (the dashboard then shows no diff, the
    trajectory never carries one)."""
    asked = spec.agent.collect_diff
    return may_read_workspace(spec.evaluator.name) if asked is None else asked


def baseline_command() -> str:
    """Snapshot the prepared workdir so the diff later shows only the agent's changes.
    No template (sample hooks and the like): fewer files to create and remove per session."""
    return (
        f"{GIT} init -q --template= 2>/dev/null; {GIT} add -A && "
        f"{GIT} commit -q --allow-empty --no-verify -m 'polar baseline'"
    )


def diff_command(harness: Harness) -> str:
    """A diff of the workdir against the baseline, untracked files included, the
    harness's own config/log paths excluded."""
    excludes = " ".join(shlex.quote(f":(exclude){p}") for p in harness.own_paths)
    return f"{GIT} add -A && {GIT} diff --cached --binary HEAD -- . {excludes}"


def tail(data: bytes, limit: int) -> str:
    return data[-limit:].decode("utf-8", "replace")


def untar_texts(data: bytes, limit: int) -> dict[str, str]:
    """Regular files of a tar, as text (each capped at ``limit`` bytes, tail kept)."""
    out: dict[str, str] = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            if member.isfile():
                f = tar.extractfile(member)
                if f is not None:
                    out[member.name.lstrip("./")] = tail(f.read(), limit)
    return out


def installed_version(logs: dict[str, str]) -> str | None:
    """The CLI version INIT recorded in the sandbox (``.polar/logs/harness.json``), as
    collected with the logs through the runtime: the executor may not share the sandbox's
    files (docker, apptainer, another process's view)."""
    try:
        record = orjson.loads(logs.get("logs/harness.json", "{}"))
    except orjson.JSONDecodeError:
        return None
    version = record.get("version") if isinstance(record, dict) else None
    return str(version) if version else None


def log_paths(harness: Harness, ctx: HarnessContext) -> list[str]:
    """Where the harness's own logs live (inside paths)."""
    import posixpath

    home_paths = [posixpath.join(ctx.home, p) for p in harness.own_paths]
    return [ctx.log_dir, *home_paths]
