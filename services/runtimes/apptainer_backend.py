"""The apptainer runtime: a rootless instance driven through the `apptainer` CLI.

Every apptainer call goes through one boundary, `ApptainerSandboxRuntime._cli`, with
argvs built by the pure functions below. Apptainer cannot be installed on the machines
this project is developed on, so the tests check these exact argvs at the CLI boundary
against a stand-in `apptainer` executable; no real instance has been started by them.

The session directory on the node holds `workdir/` and `home/`, bound at `spec.workdir`
and `/home/polar` in the instance, so files under those paths move as node file I/O;
other paths go through `sh`, `cat` and `tar` inside the instance.
"""

from __future__ import annotations

import asyncio
import os
import posixpath
import shutil
from pathlib import Path

from schemas.task import ApptainerRuntime as ApptainerRuntimeSpec
from services.runtimes import tarutil
from services.runtimes.base import ExecResult, OutputBuffer, Process, Runtime, Sink, new_exec_id
from services.runtimes.errors import SandboxIOError, SandboxStartError, SandboxUnavailable
from services.runtimes.hostfs import confined, read_file, read_node_file, write_file
from services.runtimes.local_process import LocalProcess, spawn_local
from services.runtimes.procs import TAG_EXEC, TAG_RUNTIME, TAG_SESSION, kill_tree

HOME_INSIDE = "/home/polar"
CLI_TIMEOUT_SECONDS = 300.0  # instance start may pull and convert an image
_NETWORK_FLAGS = {"host": [], "none": ["--net", "--network", "none"]}
_NETWORK_FLAGS["bridge"] = ["--net", "--network", "bridge"]  # needs privileges or fakeroot


def instance_name(runtime_id: str) -> str:
    return f"polar-{runtime_id}"


def env_flags(env: dict[str, str]) -> list[str]:
    return [arg for k, v in sorted(env.items()) for arg in ("--env", f"{k}={v}")]


def start_argv(spec: ApptainerRuntimeSpec, name: str, session_dir: Path) -> list[str]:
    argv = ["apptainer", "instance", "start", "--contain", "--writable-tmpfs", "--cleanenv"]
    argv += ["--home", f"{session_dir / 'home'}:{HOME_INSIDE}"]
    argv += ["--bind", f"{session_dir / 'workdir'}:{spec.workdir}"]
    for bind in spec.binds:
        argv += ["--bind", bind]
    argv += _NETWORK_FLAGS[spec.network]
    if spec.resources.cpus is not None:
        argv += ["--cpus", f"{spec.resources.cpus:g}"]
    if spec.resources.memory_mb is not None:
        argv += ["--memory", f"{spec.resources.memory_mb}M"]
    return [*argv, *env_flags(spec.env), spec.image, name]


def exec_argv(name: str, argv: list[str], *, cwd: str, env: dict[str, str]) -> list[str]:
    head = ["apptainer", "exec", "--cleanenv", "--pwd", cwd, *env_flags(env)]
    return [*head, f"instance://{name}", *argv]


def stop_argv(name: str, *, force: bool) -> list[str]:
    return ["apptainer", "instance", "stop", *(["--force"] if force else []), name]


class ApptainerSandboxRuntime(Runtime):
    def __init__(
        self,
        spec: ApptainerRuntimeSpec,
        session_id: str,
        runtime_id: str,
        *,
        base_dir: Path,
        proxy_url: str | None = None,
        keep_files: bool = False,
    ) -> None:
        super().__init__(
            runtime_id,
            session_id,
            workdir=spec.workdir,
            home=HOME_INSIDE,
            env=spec.env,
            proxy_url=proxy_url,
        )
        self.spec = spec
        self.name = instance_name(runtime_id)
        self.session_dir = (base_dir / runtime_id).absolute()
        self.keep_files = keep_files

    async def _cli(self, argv: list[str], *, stdin: bytes | None = None) -> ExecResult:
        """The one place this runtime runs the apptainer CLI (outside any exec)."""
        out, err = OutputBuffer(), OutputBuffer()
        env = {**_node_env(), TAG_RUNTIME: self.runtime_id}
        proc = await spawn_local(
            argv, cwd=str(self.session_dir), env=env, exec_id=new_exec_id(), stdin=stdin,
            stdout=out, stderr=err,
        )  # fmt: skip
        status = await proc.wait(CLI_TIMEOUT_SECONDS)
        return ExecResult(status.exit_code, out.data(), err.data(), status.timed_out, 0.0)

    # -- lifecycle ------------------------------------------------------------------
    async def _start(self) -> None:
        if shutil.which("apptainer") is None:
            raise SandboxUnavailable("apptainer is not installed on this node")
        for sub in ("workdir", "home"):
            (self.session_dir / sub).mkdir(parents=True, exist_ok=True)
        await self._cli(stop_argv(self.name, force=True))  # a crashed node's leftover
        result = await self._cli(start_argv(self.spec, self.name, self.session_dir))
        if not result.ok:
            reason = result.stderr.decode(errors="replace").strip()
            raise SandboxStartError(f"apptainer instance start failed: {reason}")

    async def _release(self) -> None:
        for proc in self._procs:
            if isinstance(proc, LocalProcess):
                proc.close_pipes()

    async def _teardown(self, grace: float) -> None:
        if self.session_dir.exists():
            await self._cli(stop_argv(self.name, force=grace == 0))
        # Exec clients and (without a PID namespace) instance processes are node processes.
        await kill_tree(None, (TAG_RUNTIME, self.runtime_id), grace)
        await self._release()
        if not self.keep_files:
            shutil.rmtree(self.session_dir, ignore_errors=True)

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
        # The tags go both to the node-side client (its env) and into the instance (--env).
        return await spawn_local(
            exec_argv(self.name, argv, cwd=cwd, env=env),
            cwd=str(self.session_dir),
            env={**_node_env(), **{k: env[k] for k in (TAG_SESSION, TAG_RUNTIME, TAG_EXEC)}},
            exec_id=exec_id,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
        )

    # -- files ----------------------------------------------------------------------
    def node_path(self, inside: str) -> Path | None:
        """Where an inside path lives on the node, if it is under a bound directory."""
        for mount, sub in ((self.spec.workdir, "workdir"), (HOME_INSIDE, "home")):
            if inside == mount or inside.startswith(mount.rstrip("/") + "/"):
                rel = posixpath.relpath(inside, mount)
                return confined(self.session_dir / sub, self.session_dir / sub / rel)
        return None

    async def _inside(self, script: str, *args: str, stdin: bytes | None = None) -> bytes:
        result = await self.exec(["sh", "-c", script, "sh", *args], stdin=stdin, timeout=600)
        if not result.ok:
            raise SandboxIOError(result.stderr.decode(errors="replace").strip() or script)
        return result.stdout

    async def upload_file(
        self, dest: str, data: bytes | None = None, *, src: Path | None = None, mode: int = 0o644
    ) -> None:
        self._require_running()
        content = data if data is not None else read_node_file(src)
        inside = self.inside_path(dest)
        if (node := self.node_path(inside)) is not None:
            return await asyncio.to_thread(write_file, node, content, mode)
        script = f'mkdir -p "$(dirname "$1")" && cat > "$1" && chmod {mode:o} "$1"'
        await self._inside(script, inside, stdin=content)

    async def upload_dir(self, src: Path, dest: str = ".") -> None:
        self._require_running()
        archive = await asyncio.to_thread(tarutil.dir_tar, Path(src))
        inside = self.inside_path(dest)
        if (node := self.node_path(inside)) is not None:
            return await asyncio.to_thread(tarutil.extract_tar, archive, node)
        await self._inside('mkdir -p "$1" && tar -x -C "$1"', inside, stdin=archive)

    async def download(self, path: str) -> bytes:
        self._require_running()
        inside = self.inside_path(path)
        if (node := self.node_path(inside)) is not None:
            return await asyncio.to_thread(read_file, node)
        return await self._inside('cat "$1"', inside)

    async def download_tar(self, path: str) -> bytes:
        self._require_running()
        inside = self.inside_path(path)
        if (node := self.node_path(inside)) is not None:
            return await asyncio.to_thread(tarutil.dir_tar, node)
        return await self._inside('tar -c -C "$1" .', inside)


def _node_env() -> dict[str, str]:
    """The CLI client needs the node's environment (HOME for its instance registry,
    XDG_RUNTIME_DIR for rootless cgroups); `--cleanenv` keeps it out of the instance."""
    return dict(os.environ)
