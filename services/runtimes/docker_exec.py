"""A command running in a container through the Docker exec API.

docker-py's exec has no timeout and no kill. Killing is done from inside the container:
every exec carries `POLAR_EXEC_ID` in its environment, and a sweep exec signals every
process whose /proc/<pid>/environ holds it (children that called setsid included). The
sweep needs `sh`, `tr`, `grep`, `kill` and `sleep` in the image (busybox or coreutils).
A blocking output stream is pumped by one dedicated thread per exec.

Every exec waits for a handshake before it runs (``attached_argv``): podman's Docker API
(and Docker once, moby#27289) drops what an exec writes before the client's attach is in
place. Under load 3 of 60 `cat` execs came back empty with exit code 0 (an evaluator
reading a test's output would have read nothing); 0 of 60 with the handshake.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

from docker.utils.socket import demux_adaptor, frames_iter

from services.runtimes.base import ExitStatus, Process, Sink

_STREAM_CLOSE_SECONDS = 5.0  # after a kill, how long the output stream may take to end

# $1: NAME=VALUE tag, $2: ticks of 0.1 s to wait after TERM. KILL sweeps twice: forks.
SWEEP_SCRIPT = r"""
tagged() {
  for d in /proc/[0-9]*; do
    tr '\0' '\n' < "$d/environ" 2>/dev/null | grep -qxF "$1" && echo "${d#/proc/}"
  done
}
pids=$(tagged "$1")
[ -n "$pids" ] && kill -TERM $pids 2>/dev/null
n=$2
while [ "$n" -gt 0 ] && [ -n "$(tagged "$1")" ]; do sleep 0.1; n=$((n - 1)); done
for round in 1 2; do
  pids=$(tagged "$1")
  [ -n "$pids" ] && kill -KILL $pids 2>/dev/null
done
exit 0
"""

# PID 1 of every container: a shell whose `wait` also reaps orphans re-parented to it.
REAPER_ENTRYPOINT = ["sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait; done"]


HANDSHAKE = b"attached\n"  # sent on the exec's stdin once its output is attached


def attached_argv(argv: list[str]) -> list[str]:
    """Run ``argv`` once the client says it is attached (one line on stdin); its own stdin
    is /dev/null, as an exec without one has (``stdin_argv`` replaces it with a file)."""
    return ["sh", "-c", 'read -r _ && exec "$@" </dev/null', "polar-exec", *argv]


def sweep_argv(tag: str, grace: float) -> list[str]:
    return ["sh", "-c", SWEEP_SCRIPT, "sweep", tag, str(round(grace * 10))]


def deadline_argv(argv: list[str], timeout: float | None) -> list[str]:
    """In-container backstop for a timeout the node enforces first (in case it dies)."""
    if timeout is None:
        return argv
    return ["timeout", "-s", "KILL", str(int(timeout) + 5), *argv]


def stdin_argv(argv: list[str], stdin_path: str) -> list[str]:
    """Read stdin from an uploaded file, removed as soon as it is open."""
    return ["sh", "-c", 'exec 0<"$0" && rm -f "$0" && exec "$@"', stdin_path, *argv]


class DockerProcess(Process):
    def __init__(self, api: Any, container_id: str, exec_id: str, tag: str) -> None:
        self._api = api
        self._container_id = container_id
        self._exec_id = exec_id  # the engine's exec id
        self._tag = tag  # POLAR_EXEC_ID=...
        self._started = time.monotonic()
        self._killed = False
        self._loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int | None] = self._loop.create_future()

    def start_pump(self, stdout: Sink | None, stderr: Sink | None) -> None:
        thread = threading.Thread(
            target=self._pump, args=(stdout, stderr), name=f"exec-{self._exec_id[:12]}", daemon=True
        )
        thread.start()

    def _pump(self, stdout: Sink | None, stderr: Sink | None) -> None:
        code: int | None = None
        try:
            sock = self._api.exec_start(self._exec_id, socket=True)
            try:
                getattr(sock, "_sock", sock).sendall(HANDSHAKE)  # attached: it may run now
                for stream_id, data in frames_iter(sock, tty=False):
                    out, err = demux_adaptor(stream_id, data)
                    self._deliver(stdout, out)
                    self._deliver(stderr, err)
            finally:
                sock.close()
            code = self._api.exec_inspect(self._exec_id).get("ExitCode")
        except Exception:  # the container went away under the stream: no exit code
            code = None
        self._call_soon(self._set_exit, code)

    def _deliver(self, sink: Sink | None, chunk: bytes | None) -> None:
        if sink is not None and chunk:
            self._call_soon(sink, chunk)

    def _call_soon(self, fn: Any, *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
            self._loop.call_soon_threadsafe(fn, *args)

    def _set_exit(self, code: int | None) -> None:
        if not self._exited.done():
            self._exited.set_result(code)

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    async def wait(self, timeout: float | None = None, *, grace: float = 1.0) -> ExitStatus:
        timed_out = False
        try:
            code = await asyncio.wait_for(asyncio.shield(self._exited), timeout)
        except TimeoutError:
            timed_out = True
            await self.kill(grace)
            code = await self._settle()
        return ExitStatus(code, timed_out, time.monotonic() - self._started, self._killed)

    async def kill(self, grace: float = 0.0) -> None:
        self._killed = self._killed or not self._exited.done()
        await asyncio.to_thread(self._sweep, grace)
        await self._settle()

    def _sweep(self, grace: float) -> None:
        with contextlib.suppress(Exception):  # the container may already be gone
            sweep = self._api.exec_create(self._container_id, sweep_argv(self._tag, grace))
            self._api.exec_start(sweep["Id"])

    async def _settle(self) -> int | None:
        try:
            return await asyncio.wait_for(asyncio.shield(self._exited), _STREAM_CLOSE_SECONDS)
        except TimeoutError:
            return None
