"""The docker runtime: one container per session through docker-py (Docker or podman's API).

The container's PID 1 is a reaping shell loop; every command is an exec. Blocking docker-py calls
run in threads; docker exceptions are translated to `SandboxError`s here, once. The
container's name is derived from the runtime id, so a restarted node removes what a
crashed one left. Images need `sh`, `sleep`, `timeout`, `tr`, `grep` (busybox suffices).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import posixpath
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import docker
import docker.errors
import requests

from schemas.task import DockerRuntime as DockerRuntimeSpec
from services.runtimes import tarutil
from services.runtimes.base import Process, Runtime, Sink
from services.runtimes.docker_exec import (
    REAPER_ENTRYPOINT,
    DockerProcess,
    attached_argv,
    deadline_argv,
    stdin_argv,
    sweep_argv,
)
from services.runtimes.errors import (
    SandboxError,
    SandboxExecError,
    SandboxIOError,
    SandboxStartError,
    SandboxUnavailable,
)
from services.runtimes.hostfs import read_node_file
from services.runtimes.procs import TAG_EXEC, TAG_RUNTIME

T = TypeVar("T")
LABEL_RUNTIME = "polar.runtime"
LABEL_SESSION = "polar.session"
_API_VERSIONS: dict[str, str] = {}  # engine address -> negotiated API version


def container_name(runtime_id: str) -> str:
    return f"polar-{runtime_id}"


def create_kwargs(spec: DockerRuntimeSpec, runtime_id: str, session_id: str) -> dict[str, Any]:
    """Arguments for `containers.create` (pure, so tests can read them)."""
    kwargs: dict[str, Any] = {
        "image": spec.image,
        "entrypoint": REAPER_ENTRYPOINT,
        "name": container_name(runtime_id),
        "labels": {LABEL_RUNTIME: runtime_id, LABEL_SESSION: session_id},
        "working_dir": spec.workdir,
        "environment": dict(spec.env),
        "network_mode": spec.network,
        "volumes": list(spec.mounts),
        "detach": True,
    }
    if spec.resources.cpus is not None:
        kwargs["nano_cpus"] = int(spec.resources.cpus * 1e9)
    if spec.resources.memory_mb is not None:
        kwargs["mem_limit"] = f"{spec.resources.memory_mb}m"
    return kwargs


def recorded_home(record_dir: Path) -> str | None:
    """$HOME as probed by the process that started the container (for adopters)."""
    try:
        return json.loads((record_dir / "runtime.json").read_bytes()).get("home")
    except (OSError, ValueError):
        return None


def write_record(record_dir: Path, record: dict[str, str]) -> None:
    record_dir.mkdir(parents=True, exist_ok=True)
    (record_dir / "runtime.json").write_text(json.dumps(record))


@contextlib.contextmanager
def translated(action: str, kind: type[SandboxError] = SandboxError) -> Iterator[None]:
    """docker-py and transport exceptions -> SandboxError, with what we were doing."""
    try:
        yield
    except docker.errors.ImageNotFound as exc:
        raise SandboxStartError(f"{action}: image not found: {exc.explanation}") from exc
    except docker.errors.NotFound as exc:
        raise kind(f"{action}: not found: {exc.explanation}") from exc
    except docker.errors.APIError as exc:
        raise kind(f"{action}: {exc.explanation or exc}") from exc
    except (docker.errors.DockerException, requests.RequestException, OSError) as exc:
        raise SandboxUnavailable(f"{action}: docker engine unreachable: {exc}") from exc


class DockerSandboxRuntime(Runtime):
    def __init__(
        self,
        spec: DockerRuntimeSpec,
        session_id: str,
        runtime_id: str,
        *,
        base_dir: Path,
        proxy_url: str | None = None,
        docker_host: str | None = None,
    ) -> None:
        self.record_dir = (base_dir / runtime_id).absolute()  # runtime.json for adopters
        super().__init__(
            runtime_id,
            session_id,
            workdir=spec.workdir,
            home=recorded_home(self.record_dir) or spec.env.get("HOME", "/root"),
            env=spec.env,
            proxy_url=proxy_url,
        )
        self.spec = spec
        self.docker_host = docker_host
        self._client: docker.DockerClient | None = None
        self._container: Any = None
        self._adopted = False
        self._started = False

    def adopt(self) -> Runtime:
        self._adopted = True
        return super().adopt()

    async def _call(self, action: str, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """Run a blocking docker call in a thread. If the caller is cancelled meanwhile,
        the call still completes before the cancellation goes on, so that teardown sees
        whatever it created."""
        kind = kw.pop("_kind", SandboxError)

        def call() -> T:
            with translated(action, kind):
                return fn(*args, **kw)

        fut = asyncio.get_running_loop().run_in_executor(None, call)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await fut
            raise

    # -- lifecycle ------------------------------------------------------------------
    async def _start(self) -> None:
        self._started = True
        self._client = await self._call("connect", self._connect, _kind=SandboxUnavailable)
        await self._call("remove stale container", self._remove_container)
        kwargs = create_kwargs(self.spec, self.runtime_id, self.session_id)
        self._container = await self._call(
            "create container", self._create, kwargs, _kind=SandboxStartError
        )
        await self._call("start container", self._container.start, _kind=SandboxStartError)
        probe = await self.exec_probe()
        if probe is not None:
            self.home = probe
        await asyncio.to_thread(write_record, self.record_dir, {"home": self.home})

    async def _attached(self) -> Any:
        """The container, looked up by name when this object adopted it."""
        if self._container is None:
            if self._client is None:
                self._client = await self._call("connect", self._connect, _kind=SandboxUnavailable)
            name = container_name(self.runtime_id)
            self._container = await self._call(
                f"find container {name}", self._client.containers.get, name
            )
        return self._container

    def _connect(self) -> docker.DockerClient:
        key = self.docker_host or os.environ.get("DOCKER_HOST", "")
        version = _API_VERSIONS.get(key)  # None: ask the engine (podman takes ~1 s)
        if self.docker_host:
            client = docker.DockerClient(base_url=self.docker_host, version=version)
        else:
            client = docker.from_env(version=version)
        _API_VERSIONS.setdefault(key, client.api.api_version)
        return client

    def _create(self, kwargs: dict[str, Any]) -> Any:
        assert self._client is not None
        try:
            return self._client.containers.create(**kwargs)
        except docker.errors.ImageNotFound:
            self._client.images.pull(self.spec.image)
            return self._client.containers.create(**kwargs)

    async def exec_probe(self) -> str | None:
        """A first exec proves the image can run commands; it also reads $HOME."""
        result = await self.exec(["sh", "-c", 'printf %s "$HOME"'], timeout=30)
        if not result.ok:
            err = result.stderr.decode(errors="replace")
            raise SandboxStartError(f"image {self.spec.image!r} cannot run sh: {err}")
        return result.stdout.decode() or None

    async def _teardown(self, grace: float) -> None:
        await asyncio.to_thread(shutil.rmtree, self.record_dir, True)
        if not (self._started or self._adopted):
            return  # nothing was created
        with contextlib.suppress(SandboxError):
            live = self._adopted or any(p.returncode is None for p in self._procs)
            if grace > 0 and live:  # let the processes end on SIGTERM first
                tag = f"{TAG_RUNTIME}={self.runtime_id}"
                container = await self._attached()
                await self._call("terminate", container.exec_run, sweep_argv(tag, grace))
            if self._client is None:
                self._client = await self._call("connect", self._connect, _kind=SandboxUnavailable)
            await self._call("remove container", self._remove_container)
        await self._release()

    async def _release(self) -> None:
        self._container = None
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()

    def _remove_container(self) -> None:
        assert self._client is not None
        try:
            self._client.containers.get(container_name(self.runtime_id)).remove(force=True, v=True)
        except docker.errors.NotFound:
            pass

    # -- processes ------------------------------------------------------------------
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
    ) -> Process:
        argv = deadline_argv(argv, timeout)
        if stdin is not None:
            stdin_path = f"/tmp/.polar-stdin-{exec_id}"
            await self._put_file(stdin_path, stdin, 0o600)
            argv = stdin_argv(argv, stdin_path)
        container = await self._attached()
        api = container.client.api
        created = await self._call(
            "exec",
            api.exec_create,
            container.id,
            attached_argv(argv),
            environment=env,
            workdir=cwd,
            stdin=True,  # for the handshake only (docker_exec.attached_argv)
            _kind=SandboxExecError,
        )
        proc = DockerProcess(api, container.id, created["Id"], f"{TAG_EXEC}={exec_id}")
        proc.start_pump(stdout, stderr)
        return proc

    # -- files ----------------------------------------------------------------------
    async def _put_file(self, path: str, data: bytes, mode: int) -> None:
        parent, name = posixpath.split(path)
        await self._put_archive(parent, tarutil.file_tar(name, data, mode))

    async def _put_archive(self, dest_dir: str, archive: bytes) -> None:
        put = (await self._attached()).put_archive
        try:
            await self._call(f"upload to {dest_dir}", put, dest_dir, archive, _kind=SandboxIOError)
        except SandboxIOError:
            await self._mkdir(dest_dir)
            await self._call(f"upload to {dest_dir}", put, dest_dir, archive, _kind=SandboxIOError)

    async def _mkdir(self, path: str) -> None:
        result = await self.exec(["mkdir", "-p", path], timeout=30)
        if not result.ok:
            raise SandboxIOError(f"cannot create {path}: {result.stderr.decode(errors='replace')}")

    async def upload_file(
        self, dest: str, data: bytes | None = None, *, src: Path | None = None, mode: int = 0o644
    ) -> None:
        self._require_running()
        if data is None:
            data = await asyncio.to_thread(read_node_file, src)
        await self._put_file(self.inside_path(dest), data, mode)

    async def upload_dir(self, src: Path, dest: str = ".") -> None:
        self._require_running()
        archive = await asyncio.to_thread(tarutil.dir_tar, Path(src))
        await self._put_archive(self.inside_path(dest), archive)

    async def _get_archive(self, path: str) -> bytes:
        container = await self._attached()

        def fetch() -> bytes:
            stream, _stat = container.get_archive(path)
            return b"".join(stream)

        return await self._call(f"download {path}", fetch, _kind=SandboxIOError)

    async def download(self, path: str) -> bytes:
        self._require_running()
        return tarutil.single_file(await self._get_archive(self.inside_path(path)))

    async def download_tar(self, path: str) -> bytes:
        self._require_running()
        return tarutil.strip_top_dir(await self._get_archive(self.inside_path(path)))
