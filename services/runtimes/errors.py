"""Sandbox errors: what a runtime raises, already translated from docker/OS exceptions.

    SandboxError                 base; `retryable` says whether a retry may help
    ├── SandboxConfigError       the spec cannot be honoured here (fatal for the session)
    ├── SandboxUnavailable       engine or binary missing/unreachable (retryable)
    ├── SandboxStartError        the sandbox did not come up
    ├── SandboxExecError         a command could not be started (not: it exited non-zero)
    ├── SandboxIOError           upload/download failed or a path escaped the sandbox
    └── RuntimeStopped           the runtime was stopped or cancelled under the caller

A command that exits non-zero or times out is not an error: it is an `ExecResult`.
"""

from __future__ import annotations


class SandboxError(Exception):
    retryable: bool = False

    def __init__(self, message: str, *, runtime_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.runtime_id = runtime_id

    def __str__(self) -> str:
        where = f"[{self.runtime_id}] " if self.runtime_id else ""
        return f"{where}{self.message}"


class SandboxConfigError(SandboxError):
    pass


class SandboxUnavailable(SandboxError):
    retryable = True


class SandboxStartError(SandboxError):
    retryable = True


class SandboxExecError(SandboxError):
    pass


class SandboxIOError(SandboxError):
    pass


class RuntimeStopped(SandboxError):
    pass
