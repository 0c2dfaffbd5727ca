"""A session on a node: where its files live, what its harness is told, its runtime."""

from __future__ import annotations

import functools
import os
import posixpath
from dataclasses import dataclass
from pathlib import Path

from schemas import Session, TaskRequest
from services.node.harnesses.base import HarnessContext


@dataclass(frozen=True)
class SessionPaths:
    """Node-side directories of one session."""

    sessions_dir: Path  # runtimes keep their session directories under here
    logs: Path  # prepare logs, harness stdout/stderr, collected harness logs

    @classmethod
    def of(cls, work_dir: str | Path, session_id: str) -> SessionPaths:
        sessions, logs = _node_dirs(work_dir)
        return cls(sessions_dir=sessions, logs=logs / session_id)


def sessions_dir(work_dir: str | Path) -> Path:
    """Where the node's runtimes keep their session directories."""
    return _node_dirs(work_dir)[0]


def _node_dirs(work_dir: str | Path) -> tuple[Path, Path]:
    return _dirs(work_dir) if os.path.isabs(work_dir) else _dirs.__wrapped__(work_dir)


@functools.lru_cache(maxsize=64)
def _dirs(work_dir: str | Path) -> tuple[Path, Path]:
    """The node's sessions and logs directories, from its work dir resolved once per
    process when absolute (a relative one follows the cwd, which may change): a few
    syscalls per path part and several pathlib joins, several times per session
    otherwise."""
    root = Path(work_dir).resolve()
    return root / "sessions", root / "logs"


def harness_context(
    session: Session, task: TaskRequest, runtime, proxy_url: str, paths: SessionPaths
) -> HarnessContext:
    home = runtime.home
    return HarnessContext(
        session_id=session.session_id,
        task_id=session.task_id,
        attempt=session.attempt,
        instruction=task.instruction,
        token=session.token,
        proxy_url=runtime.proxy_url or proxy_url,  # a sandbox may reach it through a bridge
        agent=task.agent,
        workdir=runtime.workdir,
        home=home,
        log_dir=posixpath.join(home, ".polar", "logs"),
        artifact_dir=posixpath.join(home, ".polar", "artifacts"),
        task_env=dict(task.runtime.env),
    )


def node_runtime(
    config,
    spec,
    session_id: str,
    runtime_id: str | None = None,
    role: str = "main",
    *,
    attempt: int | None = None,
    harness: str | None = None,
    token: str | None = None,
):
    """A runtime of this node: a new one (``runtime_id`` None) for the session's
    ``attempt`` (named by it: ``runtime_id_for``), or one that exists already (prepared
    by the pool, or left by a process that died). ``harness``: the task's, which
    decides what ``sandbox: auto`` means (every caller passes it: the same session gets
    the same sandbox from the pool, the executor and the evaluator). ``token``: the
    session's, for the runtimes that run its harness (the pool's prepare, the
    executor's run): a `network: none` sandbox reaches only that session's routes."""
    from services.runtimes.factory import adopt_runtime, create_runtime, with_default_sandbox

    spec = with_default_sandbox(spec, harness)
    kw = dict(
        base_dir=sessions_dir(config.work_dir),
        proxy_url=config.proxy_url,
        docker_host=config.docker_host,
        token=token,
    )
    if runtime_id is None:
        if attempt is None:
            raise ValueError("a new runtime is named by its session's attempt: pass attempt=")
        return create_runtime(spec, session_id, attempt=attempt, role=role, **kw)
    return adopt_runtime(spec, session_id, runtime_id, **kw)
