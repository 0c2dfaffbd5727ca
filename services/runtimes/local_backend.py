"""The local runtime: a per-session directory on this node, optionally under bubblewrap.

Layout under `base_dir/<runtime_id>/`: `workdir/` (the harness's cwd), `home/`, `tmp/`,
`logs/`, `artifacts/`. Paths inside the sandbox equal paths on the node (bwrap binds the
session directory at its own path), so file transfer is plain file I/O, confined to the
session directory. The environment is built, not inherited: PATH, LANG, LC_ALL, TZ from
the node, HOME/TMPDIR from the session, then the spec's and the call's variables.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from schemas.task import LocalRuntime as LocalRuntimeSpec
from services.runtimes import tarutil
from services.runtimes.base import Process, Runtime, Sink
from services.runtimes.bridge import ProxyBridge, inside_proxy_url, proxy_address
from services.runtimes.bwrap import bridge_prefix, bwrap_argv
from services.runtimes.errors import SandboxConfigError, SandboxUnavailable
from services.runtimes.hostfs import confined, read_file, read_node_file, write_file
from services.runtimes.local_process import LocalProcess, spawn_local
from services.runtimes.procs import TAG_RUNTIME, kill_tree, kill_trees

SESSION_SUBDIRS = ("workdir", "home", "tmp", "logs", "artifacts")
PASSTHROUGH_ENV = ("PATH", "LANG", "LC_ALL", "TZ")


def check_local_spec(spec: LocalRuntimeSpec) -> None:
    if spec.network == "bridge":
        raise SandboxConfigError("local runtimes support network 'host' or 'none', not 'bridge'")
    if spec.network == "none" and spec.sandbox == "none":
        raise SandboxConfigError("network 'none' needs sandbox 'bwrap' on a local runtime")


class LocalSandboxRuntime(Runtime):
    def __init__(
        self,
        spec: LocalRuntimeSpec,
        session_id: str,
        runtime_id: str,
        *,
        base_dir: Path,
        proxy_url: str | None = None,
        keep_files: bool = False,
        token: str | None = None,
    ) -> None:
        check_local_spec(spec)
        self.spec = spec
        self.session_dir = (base_dir / runtime_id).absolute()
        self.base_dir = base_dir.absolute()
        self.keep_files = keep_files
        self._bridge: ProxyBridge | None = None
        self._bridge_dir: str | None = None
        self._proxy_target = proxy_url
        self._token = token  # the session's: the only routes its bridge passes
        if self._uses_bridge and proxy_url is not None:
            proxy_url = inside_proxy_url(proxy_url)
        super().__init__(
            runtime_id,
            session_id,
            workdir=str(self.session_dir / "workdir"),
            home=str(self.session_dir / "home"),
            env=spec.env,
            proxy_url=proxy_url,
        )

    @property
    def bridge_dir(self) -> Path | None:
        """The node directory holding the proxy bridge's socket, while one runs."""
        return Path(self._bridge_dir) if self._bridge_dir else None

    @property
    def _bwrap(self) -> bool:  # an undecided `auto` (no harness known) is none
        return self.spec.sandbox == "bwrap" or (
            self.spec.sandbox == "auto" and self.spec.network == "none"
        )

    @property
    def _isolated(self) -> bool:
        """The session's network is its own loopback and the proxy bridge: `none`, or
        `auto` (the default) in bubblewrap. `auto` without bubblewrap is the node's
        network, as is `host` (with_default_sandbox warns of both)."""
        net = self.spec.network
        return net == "none" or (net == "auto" and self._bwrap)

    @property
    def _uses_bridge(self) -> bool:
        return self._bwrap and self._isolated

    # -- lifecycle ------------------------------------------------------------------
    async def _start(self) -> None:
        if self._bwrap and shutil.which("bwrap") is None:
            raise SandboxUnavailable("bwrap is not installed (apt-get install bubblewrap)")
        if not self.first_attempt:  # an earlier try's processes (an INIT run again in place)
            await kill_tree(None, (TAG_RUNTIME, self.runtime_id), 0.0)
        root = str(self.session_dir)
        if not self.first_attempt:  # a first try's directory cannot exist yet
            shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root, exist_ok=True)  # plain os calls: once per session (hot path)
        for sub in SESSION_SUBDIRS:
            with contextlib.suppress(FileExistsError):
                os.mkdir(f"{root}/{sub}")
        await self._ensure_bridge()

    async def _ensure_bridge(self) -> None:
        """The node side of the proxy bridge, owned by whichever object runs commands
        (each bwrap invocation binds the socket of the object that starts it)."""
        if self._bridge is not None or not self._uses_bridge or self._proxy_target is None:
            return
        # Unix socket paths are short (108 bytes): keep it out of the session path.
        self._bridge_dir = tempfile.mkdtemp(prefix="polar-br-")
        target = proxy_address(self._proxy_target)
        self._bridge = ProxyBridge(Path(self._bridge_dir) / "proxy.sock", target, self._token)
        await self._bridge.start()

    async def _release(self) -> None:
        for p in self._procs:
            if isinstance(p, LocalProcess):
                p.close_pipes()
        if self._bridge is not None:
            await self._bridge.close()
            self._bridge = None
        if self._bridge_dir is not None:
            shutil.rmtree(self._bridge_dir, ignore_errors=True)
            self._bridge_dir = None

    async def _teardown(self, grace: float) -> None:
        # Every process of this runtime carries its tag: one kill of all their groups and
        # tagged processes (one /proc scan when all have exited) instead of one per exec.
        procs = [p for p in self._procs if isinstance(p, LocalProcess)]
        for p in procs:
            p.mark_killed()
        await kill_trees([p.pid for p in procs], (TAG_RUNTIME, self.runtime_id), grace)
        await asyncio.gather(*(p.reap() for p in procs))
        await self._release()
        if not self.keep_files:  # in a thread: removing a tree is slow on some disks
            await asyncio.to_thread(shutil.rmtree, self.session_dir, ignore_errors=True)

    # -- processes ------------------------------------------------------------------
    def hidden_dirs(self) -> tuple[str, ...]:
        """What a sandbox must not see of this node: the work dir (every session's
        files and logs) and, when it is a stack's, the stack's state dir (credentials,
        server configs with passwords, service logs)."""
        work_dir = self.base_dir.parent  # <work_dir>/sessions/<runtime_id>
        stack = work_dir.parent
        is_stack = (stack / "credentials.json").exists() or (stack / "stack.json").exists()
        return (str(work_dir), *([str(stack)] if is_stack else []))

    def harness_caches(self) -> tuple[str, ...]:
        """Where this node installs harness CLIs (``executor/harnesses/install.py``): the
        sandbox runs them from there, read-only."""
        configured = os.environ.get("POLAR_HARNESS_CACHE")
        default = self.base_dir.parent / "harness-cache"  # <work_dir>/sessions/<id>
        return tuple(str(p) for p in (configured, default) if p)

    def base_env(self) -> dict[str, str]:
        env = {k: os.environ[k] for k in PASSTHROUGH_ENV if k in os.environ}
        tmp = "/tmp" if self._bwrap else str(self.session_dir / "tmp")
        return {**env, "HOME": self.home, "TMPDIR": tmp}

    def command_argv(self, argv: list[str], cwd: str, network: bool = False) -> list[str]:
        """The node command line that runs `argv` in this runtime's sandbox; `network`:
        with the node's network (a prepare step that asked for it)."""
        if not self._bwrap:
            return argv
        isolated = self._isolated and not network
        bridge = self._bridge if isolated else None
        prefix = bwrap_argv(
            session_dir=str(self.session_dir),
            cwd=cwd,
            isolate_network=isolated,
            bridge_socket=str(bridge.socket_path) if bridge else None,
            hide=self.hidden_dirs(),
            expose=self.harness_caches(),
        )
        if bridge is not None:
            prefix += bridge_prefix(bridge.target[1])
        return prefix + argv

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
        if not self._bwrap:
            cwd = str(confined(self.session_dir, cwd))
        await self._ensure_bridge()
        return await spawn_local(
            self.command_argv(argv, cwd, network),
            cwd=cwd if not self._bwrap else str(self.session_dir),
            env={**self.base_env(), **env},
            exec_id=exec_id,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
        )

    # -- files ----------------------------------------------------------------------
    async def upload_file(
        self, dest: str, data: bytes | None = None, *, src: Path | None = None, mode: int = 0o644
    ) -> None:
        self._require_running()
        content = data if data is not None else read_node_file(src)
        target = confined(self.session_dir, self.inside_path(dest))
        await asyncio.to_thread(write_file, target, content, mode)

    async def upload_dir(self, src: Path, dest: str = ".") -> None:
        self._require_running()
        target = confined(self.session_dir, self.inside_path(dest))
        # Through tar's "data" filter: a symlink the sandbox planted cannot redirect a write.
        archive = await asyncio.to_thread(tarutil.dir_tar, Path(src))
        await asyncio.to_thread(tarutil.extract_tar, archive, target)

    async def download(self, path: str) -> bytes:
        self._require_running()
        target = confined(self.session_dir, self.inside_path(path))
        return await asyncio.to_thread(read_file, target)

    async def download_tar(self, path: str) -> bytes:
        self._require_running()
        target = confined(self.session_dir, self.inside_path(path))
        return await asyncio.to_thread(tarutil.dir_tar, target)
