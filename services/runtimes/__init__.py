"""Sandbox runtimes behind one async interface: local (optionally bubblewrap), docker,
apptainer. See docs/runtimes.md."""

from services.runtimes.base import (
    ExecResult,
    ExitStatus,
    OutputBuffer,
    Process,
    Runtime,
    Sink,
)
from services.runtimes.errors import (
    RuntimeStopped,
    SandboxConfigError,
    SandboxError,
    SandboxExecError,
    SandboxIOError,
    SandboxStartError,
    SandboxUnavailable,
)
from services.runtimes.factory import (
    RUNTIME_FACTORIES,
    RuntimeName,
    adopt_runtime,
    create_runtime,
    parse_runtime_id,
    runtime_id_for,
)
from services.runtimes.prepare import ActionLog, AttemptLog, backoff_delay, run_prepare

__all__ = [
    "RUNTIME_FACTORIES", "ActionLog", "AttemptLog", "ExecResult", "ExitStatus", "OutputBuffer",
    "Process", "Runtime", "RuntimeName", "RuntimeStopped", "SandboxConfigError", "SandboxError",
    "SandboxExecError", "SandboxIOError", "SandboxStartError", "SandboxUnavailable", "Sink",
    "adopt_runtime", "backoff_delay", "create_runtime", "parse_runtime_id", "run_prepare",
    "runtime_id_for",
]  # fmt: skip
