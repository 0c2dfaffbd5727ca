"""A host process in its own session, read and awaited without blocking the event loop.

Not asyncio's subprocess layer: there, whether `wait()` also waits for the pipes to close
changed across Python versions, and a background child holding stdout must not block the
wait. Exit is watched through a pidfd, output through non-blocking pipe readers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import tempfile
import time

from services.runtimes.base import ExitStatus, Process, Sink
from services.runtimes.errors import SandboxExecError
from services.runtimes.procs import TAG_EXEC, kill_tree

_READ_SIZE = 65536
_DRAIN_SECONDS = 0.2  # how long wait() lets the pipes drain after the main process exits
_CLOSE_READS = 16  # reads of what a pipe holds when it is closed (a pipe buffers 64 KiB)


def shell_exit_code(returncode: int) -> int:
    """Popen's -N (killed by signal N) as a shell would report it: 128+N."""
    return 128 - returncode if returncode < 0 else returncode


class _PipeReader:
    """Feeds a pipe's bytes to a sink from the event loop; `done` resolves at EOF."""

    def __init__(self, fd: int, sink: Sink | None) -> None:
        self._fd, self._sink = fd, sink
        self._loop = asyncio.get_running_loop()
        self.done: asyncio.Future[None] = self._loop.create_future()
        os.set_blocking(fd, False)
        self._loop.add_reader(fd, self._on_readable)

    def _on_readable(self) -> None:
        try:
            chunk = os.read(self._fd, _READ_SIZE)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.close()
        elif self._sink is not None:
            self._sink(chunk)

    def close(self) -> None:
        if self.done.done():
            return
        self._loop.remove_reader(self._fd)
        self._read_waiting()
        os.close(self._fd)
        self.done.set_result(None)

    def _read_waiting(self) -> None:
        """What the pipe holds now: written before a kill but not read yet (a busy event
        loop had not got to it), it would be lost with the pipe. Bounded: a writer still
        alive cannot keep this going."""
        for _ in range(_CLOSE_READS):
            try:
                chunk = os.read(self._fd, _READ_SIZE)
            except OSError:  # BlockingIOError included: nothing more now
                return
            if not chunk:
                return
            if self._sink is not None:
                self._sink(chunk)


class LocalProcess(Process):
    def __init__(self, popen: subprocess.Popen[bytes], exec_id: str, readers: list[_PipeReader]):
        self._popen = popen
        self._exec_id = exec_id
        self._readers = readers
        self._started = time.monotonic()
        self._killed = False
        loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = loop.create_future()
        self._pidfd = os.pidfd_open(popen.pid)
        loop.add_reader(self._pidfd, self._on_exit)

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        rc = self._popen.returncode
        return None if rc is None else shell_exit_code(rc)

    def _on_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._exited.set_result(shell_exit_code(self._popen.wait()))

    async def wait(self, timeout: float | None = None, *, grace: float = 1.0) -> ExitStatus:
        timed_out = False
        try:
            code = await asyncio.wait_for(asyncio.shield(self._exited), timeout)
        except TimeoutError:
            timed_out = True
            await self.kill(grace)
            code = await self._exited
        await self._drain()
        return ExitStatus(code, timed_out, time.monotonic() - self._started, self._killed)

    async def kill(self, grace: float = 0.0) -> None:
        self.mark_killed()
        await kill_tree(self._popen.pid, (TAG_EXEC, self._exec_id), grace)
        await self.reap()

    def mark_killed(self) -> None:
        """Before its tree is killed (here or by the runtime, all processes at once)."""
        self._killed = self._killed or self._popen.returncode is None

    async def reap(self) -> None:
        """After its tree was killed: its exit seen, its pipes closed."""
        if not self._exited.done():
            await self._exited
        self.close_pipes()

    async def _drain(self) -> None:
        """Let output written just before exit arrive; a background child may hold the
        pipes open for longer, and then keeps feeding the sinks until the runtime stops."""
        pending = [r.done for r in self._readers if not r.done.done()]
        if pending:
            await asyncio.wait(pending, timeout=_DRAIN_SECONDS)

    def close_pipes(self) -> None:
        for reader in self._readers:
            reader.close()


async def spawn_local(
    argv: list[str],
    *,
    cwd: str,
    env: dict[str, str],
    exec_id: str,
    stdin: bytes | None = None,
    stdout: Sink | None = None,
    stderr: Sink | None = None,
) -> LocalProcess:
    """Start `argv` as the leader of a new session (so killpg reaches its group)."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        popen = _popen(argv, cwd, env, stdin, out_w, err_w)
    except OSError as exc:
        for fd in (out_r, err_r):
            os.close(fd)
        raise SandboxExecError(f"cannot start {argv[0]!r}: {exc.strerror or exc}") from exc
    finally:
        os.close(out_w)
        os.close(err_w)
    readers = [_PipeReader(out_r, stdout), _PipeReader(err_r, stderr)]
    return LocalProcess(popen, exec_id, readers)


def _popen(
    argv: list[str], cwd: str, env: dict[str, str], stdin: bytes | None, out_w: int, err_w: int
) -> subprocess.Popen[bytes]:
    # fork+exec only: it returns as soon as the child has exec'd.
    with _stdin_file(stdin) as stdin_file:
        return subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=stdin_file,
            stdout=out_w,
            stderr=err_w,
            start_new_session=True,
            close_fds=True,
        )


@contextlib.contextmanager
def _stdin_file(data: bytes | None):
    """Stdin from a spooled file: any size, and no writer task that could deadlock."""
    if data is None:
        yield subprocess.DEVNULL
        return
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.seek(0)
        yield f
