"""Start real service processes for tests and stop them (kill -9 included)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from infra import localservers
from infra.catalog import SERVICES


class ServiceExited(RuntimeError):
    """The service process ended before it was healthy (its log's tail says why)."""


class ServiceProcess:
    def __init__(self, target: str, config: dict, log_dir: Path) -> None:
        self.target, self.config = target, dict(config)
        self.port = self.config.setdefault("port", localservers.free_port())
        self.log = log_dir / f"{target.split(':')[0].replace('.', '_')}-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    # a cap, not a wait: a start returns as soon as /healthz answers (a restart after a
    # kill -9 on a loaded CI machine once took over 30 s)
    def start(self, timeout: float = 90.0, restarts: int = 0) -> ServiceProcess:
        """Start and wait for /healthz. ``restarts``: start it again (up to that many
        times, 1 s apart), as a supervisor would, when it exits at start-up (a server it
        needs is down for a moment)."""
        for attempt in range(restarts + 1):
            try:
                return self._start_once(timeout)
            except ServiceExited:
                if attempt == restarts:
                    raise
                time.sleep(1.0)
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> ServiceProcess:
        env = {**os.environ, "POLAR_CONFIG": json.dumps(self.config)}
        native = any(k.target == self.target and k.native for k in SERVICES.values())
        code = (  # served as `polar serve` serves it
            "from infra.serve import serve_app; "
            f"serve_app({self.target!r}, '127.0.0.1', {self.port}, native={native})"
        )
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServiceExited(f"{self.target} exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=0.5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"{self.target} not healthy: {self.log.read_text()[-2000:]}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        """kill -9 the whole process group: no graceful shutdown."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            localservers.stop_process(self.proc.pid)
            self.proc.wait(10)
