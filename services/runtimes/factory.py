"""`create_runtime`: a runtime spec from the contract -> a `Runtime`, dispatched by type."""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from schemas.task import (
    ApptainerRuntime,
    DockerRuntime,
    LocalRuntime,
    RuntimeSpec,
)
from services.runtimes.apptainer_backend import ApptainerSandboxRuntime
from services.runtimes.base import Runtime
from services.runtimes.docker_backend import DockerSandboxRuntime
from services.runtimes.errors import SandboxConfigError
from services.runtimes.local_backend import LocalSandboxRuntime

_ROLE = re.compile(r"^[a-z0-9]{1,16}$")
# <session>-a<attempt>-<role>: neither the attempt's part nor the role has a '-', so the
# last two '-' parts are theirs whatever the session id holds (a greedy session part).
_RUNTIME_ID = re.compile(r"(?P<session>.+)-a(?P<attempt>0|[1-9][0-9]*)-(?P<role>[a-z0-9]{1,16})")
log = logging.getLogger(__name__)
# Harnesses that run nothing in the sandbox: `sandbox: auto` needs no bubblewrap for them.
# Every other one (the CLIs, the shell harness, a custom class) runs what the model and
# the task say, which the threat model does not trust (docs/explanation/security.md).
RUNS_NOTHING = frozenset({"noop"})
_warned: set[str] = set()


def default_sandbox(spec: Any, harness: str | None, bwrap_installed: bool) -> str | None:
    """What ``sandbox: auto`` of a local runtime means here (pure): bubblewrap for any
    harness that runs something, or an isolated network; none otherwise (the noop
    harness, or no bubblewrap installed); None when ``spec`` asks for no default."""
    if not isinstance(spec, LocalRuntime) or spec.sandbox != "auto":
        return None
    wants = spec.network == "none" or harness not in RUNS_NOTHING
    return "bwrap" if wants and (bwrap_installed or spec.network == "none") else "none"


def with_default_sandbox(spec: RuntimeSpec, harness: str | None) -> RuntimeSpec:
    """``spec`` with ``sandbox: auto`` decided for this node; a harness that runs
    something without bubblewrap is warned about, loudly, once per process."""
    if isinstance(spec, LocalRuntime) and spec.network == "host" and "host" not in _warned:
        _warned.add("host")
        log.warning(
            "network: host: a sandbox on this node reaches every port of it (NATS, Valkey, "
            "the engines, other services) and other sessions' proxy routes; the default "
            "(auto) isolates it and lets it reach only its own proxy route"
        )
    if not isinstance(spec, LocalRuntime) or spec.sandbox != "auto":
        return spec  # nothing to decide: no PATH search (several per session otherwise)
    chosen = default_sandbox(spec, harness, shutil.which("bwrap") is not None)
    if chosen is None:
        return spec
    if chosen == "none" and harness not in RUNS_NOTHING and harness not in _warned:
        _warned.add(harness)
        log.warning(
            "NO SANDBOX: harness %r runs with `sandbox: none` because bubblewrap is not "
            "installed on this node; its sessions can read each other's processes and files "
            "and the host's. Install it (apt-get install bubblewrap, or `just setup`) or "
            "set runtime.sandbox explicitly",
            harness,
        )
    return msgspec.structs.replace(spec, sandbox=chosen)


@dataclass(frozen=True)
class RuntimeOptions:
    base_dir: Path  # per-runtime directories (session files; docker: a small record)
    proxy_url: str | None = None  # the proxy as this node reaches it
    docker_host: str | None = None  # default: DOCKER_HOST / the platform default
    keep_files: bool = False  # keep session directories after stop (debugging)
    # the session's token: a `network: none` sandbox's bridge passes only its routes
    # (None: none; an eval runtime runs after the token stopped being valid anyway)
    token: str | None = None


def _local(spec: Any, session_id: str, runtime_id: str, o: RuntimeOptions) -> Runtime:
    return LocalSandboxRuntime(
        spec, session_id, runtime_id, base_dir=o.base_dir, proxy_url=o.proxy_url,
        keep_files=o.keep_files, token=o.token,
    )  # fmt: skip


def _docker(spec: Any, session_id: str, runtime_id: str, o: RuntimeOptions) -> Runtime:
    return DockerSandboxRuntime(
        spec, session_id, runtime_id, base_dir=o.base_dir, proxy_url=o.proxy_url,
        docker_host=o.docker_host,
    )  # fmt: skip


def _apptainer(spec: Any, session_id: str, runtime_id: str, o: RuntimeOptions) -> Runtime:
    return ApptainerSandboxRuntime(
        spec, session_id, runtime_id, base_dir=o.base_dir, proxy_url=o.proxy_url,
        keep_files=o.keep_files,
    )  # fmt: skip


RUNTIME_FACTORIES: dict[type, Callable[[Any, str, str, RuntimeOptions], Runtime]] = {
    LocalRuntime: _local,
    DockerRuntime: _docker,
    ApptainerRuntime: _apptainer,
}


@dataclass(frozen=True)
class RuntimeName:
    """What a runtime id is made of (``runtime_id_for``)."""

    session_id: str
    attempt: int
    role: str


def runtime_id_for(session_id: str, attempt: int, role: str = "main") -> str:
    """Deterministic, so a restarted node finds (and removes) what a crashed one left.
    Per attempt: a holder of an older attempt, back from a cut and cleaning up, stops
    only its own runtime, never the next attempt's on the same node (same session)."""
    if not _ROLE.match(role):
        raise SandboxConfigError(f"runtime role must match {_ROLE.pattern}, got {role!r}")
    if attempt < 0:
        raise SandboxConfigError(f"runtime attempt must be 0 or more, got {attempt}")
    return f"{session_id}-a{attempt}-{role}"


def parse_runtime_id(runtime_id: str) -> RuntimeName | None:
    """The session, attempt and role ``runtime_id_for`` made ``runtime_id`` of; None for a
    name it cannot have made (e.g. ``<session>-main``, from before ids had attempts)."""
    m = _RUNTIME_ID.fullmatch(runtime_id)
    if m is None:
        return None
    return RuntimeName(m["session"], int(m["attempt"]), m["role"])


def create_runtime(
    spec: RuntimeSpec,
    session_id: str,
    *,
    base_dir: Path,
    proxy_url: str | None = None,
    attempt: int = 0,
    role: str = "main",
    docker_host: str | None = None,
    keep_files: bool = False,
    token: str | None = None,
) -> Runtime:
    """A runtime for one attempt of a session (``role`` tells apart e.g. the live and a
    fresh eval one); ``token``: the session's (``RuntimeOptions.token``)."""
    factory = RUNTIME_FACTORIES.get(type(spec))
    if factory is None:
        raise SandboxConfigError(f"no runtime backend for {type(spec).__name__}")
    options = RuntimeOptions(Path(base_dir), proxy_url, docker_host, keep_files, token)
    return factory(spec, session_id, runtime_id_for(session_id, attempt, role), options)


def adopt_runtime(
    spec: RuntimeSpec,
    session_id: str,
    runtime_id: str,
    *,
    base_dir: Path,
    proxy_url: str | None = None,
    docker_host: str | None = None,
    keep_files: bool = False,
    token: str | None = None,
) -> Runtime:
    """A running runtime started elsewhere on this node (by the pool, or by a process
    that died), ready to exec, download and stop; same arguments as at creation."""
    factory = RUNTIME_FACTORIES.get(type(spec))
    if factory is None:
        raise SandboxConfigError(f"no runtime backend for {type(spec).__name__}")
    options = RuntimeOptions(Path(base_dir), proxy_url, docker_host, keep_files, token)
    return factory(spec, session_id, runtime_id, options).adopt()
