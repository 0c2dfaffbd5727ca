"""The one async interface every sandbox runtime implements.

A runtime moves new -> starting -> running -> stopping -> stopped | cancelled; `adopt()`
takes a sandbox started by another process straight to running, `detach()` hands it
over (running -> detached) without stopping it. `stop()` and `cancel()` are
idempotent and always safe (also before `start()` and after a failed start); both kill
every process the runtime started and remove what it created. `cancel()` skips the grace
period. A command exiting non-zero or timing out is data (`ExecResult`), not an error.
"""

from __future__ import annotations

import asyncio
import posixpath
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import msgspec

from services.runtimes.errors import RuntimeStopped, SandboxError
from services.runtimes.procs import TAG_EXEC, TAG_RUNTIME, TAG_SESSION

Sink = Callable[[bytes], object]
Command = str | list[str]
DEFAULT_OUTPUT_LIMIT = 8 * 1024 * 1024
_LIVE = ("starting", "running")
_DONE = ("stopped", "cancelled", "detached")


class ExitStatus(msgspec.Struct, frozen=True):
    exit_code: int | None  # 128+N when killed by signal N; None if unknown
    timed_out: bool
    duration: float
    killed: bool = False  # killed by kill(), stop() or cancel()


class ExecResult(msgspec.Struct, frozen=True):
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool
    duration: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class OutputBuffer:
    """A sink that keeps the last `limit` bytes and counts what it dropped."""

    def __init__(self, limit: int = DEFAULT_OUTPUT_LIMIT) -> None:
        self.limit = limit
        self.dropped = 0
        self._buf = bytearray()

    def __call__(self, chunk: bytes) -> None:
        self._buf += chunk
        if len(self._buf) > self.limit:
            extra = len(self._buf) - self.limit
            del self._buf[:extra]
            self.dropped += extra

    def data(self) -> bytes:
        return bytes(self._buf)


class Process(ABC):
    """A command running in a runtime; `kill` and timeouts hit its whole process tree."""

    @abstractmethod
    async def wait(self, timeout: float | None = None, *, grace: float = 1.0) -> ExitStatus:
        """Wait for exit; past `timeout`, kill the tree (SIGTERM, `grace`, SIGKILL)."""

    @abstractmethod
    async def kill(self, grace: float = 0.0) -> None:
        """Kill the whole tree; idempotent."""

    @property
    @abstractmethod
    def returncode(self) -> int | None: ...


def as_argv(cmd: Command) -> list[str]:
    """A string is a shell command line; a list is an argv."""
    return ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)


def new_exec_id() -> str:
    return secrets.token_hex(8)


class Runtime(ABC):
    """Base class: state machine, env and tags, exec on top of spawn, idempotent stop."""

    def __init__(
        self,
        runtime_id: str,
        session_id: str,
        *,
        workdir: str,
        home: str,
        env: dict[str, str],
        proxy_url: str | None = None,
    ) -> None:
        self.runtime_id = runtime_id
        self.session_id = session_id
        self.workdir = workdir  # as seen inside the sandbox
        self.home = home  # as seen inside the sandbox
        self.proxy_url = proxy_url  # the proxy as reached from inside the sandbox
        self.spec_env = dict(env)
        self.state = "new"
        self._procs: set[Process] = set()
        self._lock = asyncio.Lock()
        self.first_attempt = False

    # -- lifecycle ------------------------------------------------------------------
    async def start(self, *, first_attempt: bool = False) -> None:
        """``first_attempt``: no process of this runtime id can exist yet (ids carry the
        session's attempt, and an attempt's first INIT try starts it, once), so a backend
        need not look for a crashed run's leftovers (the local one skips its /proc scan)."""
        self.first_attempt = first_attempt
        async with self._lock:
            if self.state != "new":
                raise SandboxError(
                    f"cannot start a {self.state} runtime", runtime_id=self.runtime_id
                )
            self.state = "starting"  # backends may exec while starting (probes, mkdir)
            try:
                await self._start()
            except BaseException:
                await self._teardown(0.0)
                self.state = "stopped"
                raise
            if self.state == "starting":  # a stop() that came in meanwhile wins
                self.state = "running"

    def adopt(self) -> Runtime:
        """Take over a sandbox this node started elsewhere: by another process (the pool
        prepares, the executor runs) or by one that died (stop() then cleans it up)."""
        if self.state != "new":
            raise SandboxError(
                f"cannot adopt into a {self.state} runtime", runtime_id=self.runtime_id
            )
        self.state = "running"
        return self

    async def detach(self) -> None:
        """Hand the sandbox over without stopping it: release what this object holds on
        the node (proxy bridge, output pipes). The object is inert afterwards: exec
        raises RuntimeStopped and stop() does nothing."""
        if self.state not in _LIVE:
            return
        async with self._lock:
            await self._release()
            self._procs.clear()
            self.state = "detached"

    async def stop(self, grace: float = 2.0) -> None:
        await self._finish("stopped", grace)

    async def cancel(self) -> None:
        await self._finish("cancelled", 0.0)

    async def _finish(self, final: str, grace: float) -> None:
        if self.state in _DONE:
            return
        self.state = "stopping"  # in-flight execs see this and raise RuntimeStopped
        async with self._lock:
            if self.state in _DONE:  # a concurrent stop finished first
                return
            await self._teardown(grace)
            self._procs.clear()
            self.state = final

    async def __aenter__(self) -> Runtime:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- processes ------------------------------------------------------------------
    async def spawn(
        self,
        cmd: Command,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | None = None,
        stdout: Sink | None = None,
        stderr: Sink | None = None,
        timeout: float | None = None,
        network: bool = False,
    ) -> Process:
        """Start `cmd` inside the sandbox; its output goes to the sinks as it arrives.

        `timeout` is only a backstop that backends may enforce inside the sandbox (in
        case this node dies); the caller enforces the real one with `wait(timeout)`.
        `network`: this command gets the node's network even where the session's is
        isolated (a prepare step that installs; local runtimes: a container's network is
        its runtime's)."""
        self._require_running()
        exec_id = new_exec_id()
        full_env = {**self.spec_env, **(env or {}), **self.tags(exec_id)}
        proc = await self._spawn(
            as_argv(cmd),
            cwd=self.inside_path(cwd or "."),
            env=full_env,
            exec_id=exec_id,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            timeout=timeout,
            network=network,
        )
        self._procs.add(proc)
        return proc

    async def exec(
        self,
        cmd: Command,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
        grace: float = 0.5,
        network: bool = False,
    ) -> ExecResult:
        """Run `cmd` to completion; past `timeout` its whole tree is killed."""
        out, err = OutputBuffer(), OutputBuffer()
        started = time.monotonic()
        proc = await self.spawn(
            cmd, cwd=cwd, env=env, stdin=stdin, stdout=out, stderr=err, timeout=timeout,
            network=network,
        )  # fmt: skip
        try:
            status = await proc.wait(timeout, grace=grace)
        finally:
            self._procs.discard(proc)
        if self.state not in _LIVE:
            raise RuntimeStopped("runtime stopped during exec", runtime_id=self.runtime_id)
        return ExecResult(
            exit_code=status.exit_code,
            stdout=out.data(),
            stderr=err.data(),
            timed_out=status.timed_out,
            duration=time.monotonic() - started,
        )

    def tags(self, exec_id: str) -> dict[str, str]:
        return {TAG_SESSION: self.session_id, TAG_RUNTIME: self.runtime_id, TAG_EXEC: exec_id}

    def inside_path(self, path: str) -> str:
        """A path inside the sandbox: relative paths are relative to the workdir."""
        return posixpath.normpath(posixpath.join(self.workdir, path))

    def _require_running(self) -> None:
        if self.state not in _LIVE:
            raise RuntimeStopped(f"runtime is {self.state}", runtime_id=self.runtime_id)

    # -- files ----------------------------------------------------------------------
    @abstractmethod
    async def upload_file(
        self, dest: str, data: bytes | None = None, *, src: Path | None = None, mode: int = 0o644
    ) -> None:
        """Write `data` (or the node file `src`) to `dest`, creating parent directories."""

    @abstractmethod
    async def upload_dir(self, src: Path, dest: str = ".") -> None:
        """Copy the node directory `src` into `dest` (merged with what is there)."""

    @abstractmethod
    async def download(self, path: str) -> bytes:
        """The content of one file."""

    @abstractmethod
    async def download_tar(self, path: str) -> bytes:
        """A tar of the directory `path`; member names are relative to it."""

    # -- backend hooks --------------------------------------------------------------
    @abstractmethod
    async def _start(self) -> None: ...

    @abstractmethod
    async def _spawn(
        self,
        argv: list[str],
        *,
        cwd: str,
        env: dict[str, str],
        exec_id: str,
        stdin: bytes | None,
        stdout: Sink | None,
        stderr: Sink | None,
        timeout: float | None,
        network: bool = False,
    ) -> Process: ...

    @abstractmethod
    async def _release(self) -> None:
        """Free node-side resources of this object, leaving the sandbox running."""

    @abstractmethod
    async def _teardown(self, grace: float) -> None:
        """Kill everything and remove everything; must tolerate a half-started runtime."""
