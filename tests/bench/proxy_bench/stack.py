"""The processes under test, each pinned: NATS, Valkey, the instant backend, the Polar
proxy (its own HTTP server, ``proxy.io.native``; a checkout from before it under
granian), LiteLLM's proxy and rLLM's model gateway (uvicorn, one worker each; each peer
from a venv of its own, made on first use)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from infra import localservers
from tests.bench.proxy_bench import procs
from tests.bench.proxy_bench.backend import MODEL, VLLM_API

ROOT = Path(__file__).resolve().parents[3]
LITELLM_KEY = "sk-bench"
# LiteLLM pins rich<14 and other versions the project's venv is newer on, so it lives in
# a venv of its own (see docs/benchmarks/history.md, "Proxy"); LITELLM_BIN overrides. rLLM's gateway too
# (it needs fastapi and aiosqlite, which the project does not); RLLM_BIN overrides.
LITELLM_VENV = ROOT / ".bench" / "litellm-venv"
LITELLM_REQUIREMENT = "litellm[proxy]>=1.50"
RLLM_VENV = ROOT / ".bench" / "rllm-venv"
RLLM_REQUIREMENT = "rllm-model-gateway==0.1.0"


@dataclass
class Stack:
    work: Path
    proxy_cpus: set[int]
    other_cpus: set[int]
    procs: list[subprocess.Popen] = field(default_factory=list)
    nats_url: str = ""
    redis_url: str = ""
    bus_pgids: list[int] = field(default_factory=list)

    def start_infra(self) -> None:
        nport, rport = localservers.free_port(), localservers.free_port()
        nats = localservers.start_nats(nport, self.work / "nats")
        valkey = localservers.start_valkey(rport, self.work / "valkey")
        for p in (nats, valkey):
            procs.pin(p.pid, self.other_cpus)
            self.procs.append(p)
            self.bus_pgids.append(p.pid)
        self.nats_url, self.redis_url = f"nats://127.0.0.1:{nport}", f"redis://127.0.0.1:{rport}/0"

    def bus_cpu(self) -> float:
        return sum(procs.cpu_seconds(pgid) for pgid in self.bus_pgids)

    def start_backend(self, token_ids: list[int]) -> int:
        port = localservers.free_port()
        argv = [sys.executable, "-m", "tests.bench.proxy_bench.backend", "--port", str(port)]
        argv += ["--token-ids", ",".join(map(str, token_ids))]
        log = self.work / "backend.log"
        proc = procs.spawn(argv, log, self.other_cpus, cwd=str(ROOT))
        self.procs.append(proc)
        procs.wait_http(f"http://127.0.0.1:{port}/health", proc, log)
        return port

    def start_polar(
        self, backend_port: int, mode: str, model_dir: Path, loop: str, src: Path = ROOT
    ):
        """``src``: the checkout whose proxy runs (A/B against another commit)."""
        port = localservers.free_port()
        cfg = {
            "nats_url": self.nats_url,
            "redis_url": self.redis_url,
            "port": port,
            "mode": mode,
            "model_dir": str(model_dir),
            "backend": {"kind": "sglang", "urls": [f"http://127.0.0.1:{backend_port}"]},
        }
        env = {**os.environ, "POLAR_CONFIG": json.dumps(cfg), "PYTHONPATH": str(src)}
        argv = [sys.executable, "-c", _proxy_code(port, loop, src)]
        log = self.work / f"polar-{mode}.log"
        proc = procs.spawn(argv, log, self.proxy_cpus, env=env, cwd=str(src))
        self.procs.append(proc)
        procs.wait_http(f"http://127.0.0.1:{port}/healthz", proc, log)
        procs.pin_group(proc.pid, self.proxy_cpus)
        return proc, port

    def start_litellm(self, backend_port: int):
        port = localservers.free_port()
        cfg = self.work / "litellm.yaml"
        cfg.write_text(litellm_config(backend_port))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "LITELLM"))}
        env.update(LITELLM_TELEMETRY="False", LITELLM_LOG="ERROR", NO_DOCS="True")
        argv = [litellm_bin(), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--num_workers", "1", "--telemetry", "False"]
        log = self.work / "litellm.log"
        proc = procs.spawn(argv, log, self.proxy_cpus, env=env, cwd=str(self.work))
        self.procs.append(proc)
        procs.wait_http(f"http://127.0.0.1:{port}/health/liveliness", proc, log, timeout=180)
        procs.pin_group(proc.pid, self.proxy_cpus)
        return proc, port

    def start_rllm(self, backend_port: int):
        """rLLM's gateway with its defaults (traces to SQLite, written after the reply),
        in front of the instant engine's vLLM face; uvicorn logs warnings only, as the
        other proxies log no access lines."""
        port = localservers.free_port()
        cfg = self.work / "rllm.yaml"
        cfg.write_text(rllm_config(backend_port, port, self.work / "rllm-traces.db"))
        argv = [rllm_bin(), "--config", str(cfg)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("RLLM_GATEWAY")}
        log = self.work / "rllm.log"
        proc = procs.spawn(argv, log, self.proxy_cpus, env=env, cwd=str(self.work))
        self.procs.append(proc)
        procs.wait_http(f"http://127.0.0.1:{port}/health", proc, log)
        procs.pin_group(proc.pid, self.proxy_cpus)
        return proc, port

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            procs.stop(p)
        self.procs.clear()


def _proxy_code(port: int, loop: str, src: Path) -> str:
    """The proxy of checkout ``src`` as its ``polar serve proxy`` runs it (``loop``
    "serve"), or on asyncio's own event loop instead of uvloop (``loop`` "asyncio")."""
    if (src / "infra" / "serve.py").exists():  # proxy.io.native, since issue 18's last cut
        return (
            "from proxy.io.native import serve_native; "
            f"serve_native('proxy.main:create_app', '127.0.0.1', {port}, "
            f"uvloop={loop != 'asyncio'})"
        )
    rsgi = "rsgi=True" in (src / "infra" / "catalog.py").read_text()  # granian, 61c285d on
    interface = "RSGI" if rsgi else "ASGI"
    loops = "Loops.asyncio" if loop == "asyncio" else "Loops.uvloop"
    return textwrap.dedent(
        f"""
        from granian import Granian
        from granian.constants import Interfaces, Loops
        Granian('proxy.main:create_app', address='127.0.0.1', port={port},
                interface=Interfaces.{interface}, workers=1, factory=True,
                loop={loops}, log_access=False).serve()
        """
    )


def litellm_bin() -> str:
    explicit = os.environ.get("LITELLM_BIN")
    if explicit:
        return explicit
    in_project = Path(sys.prefix) / "bin" / "litellm"
    if in_project.exists() and not (LITELLM_VENV / "bin" / "litellm").exists():
        return str(in_project)
    return venv_script(LITELLM_VENV, LITELLM_REQUIREMENT, "litellm")


def rllm_bin() -> str:
    """RLLM_BIN (e.g. a venv with uvicorn[standard], for uvloop and httptools), else
    the bench's venv with the gateway and its declared dependencies only."""
    return os.environ.get("RLLM_BIN") or venv_script(
        RLLM_VENV, RLLM_REQUIREMENT, "rllm-model-gateway"
    )


def venv_script(venv: Path, requirement: str, script: str) -> str:
    """``script`` of ``venv``; on first use the venv is made and ``requirement``
    installed into it from PyPI."""
    path = venv / "bin" / script
    if not path.exists():
        print(f"installing {requirement} into {venv} (first use)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", requirement], check=True)
    return str(path)


def litellm_config(backend_port: int) -> str:
    """An OpenAI-compatible passthrough to the instant backend; no DB, a static key."""
    return textwrap.dedent(
        f"""
        model_list:
          - model_name: {MODEL}
            litellm_params:
              model: openai/{MODEL}
              api_base: http://127.0.0.1:{backend_port}/v1
              api_key: none
        litellm_settings:
          telemetry: false
          drop_params: true
          set_verbose: false
        general_settings:
          master_key: {LITELLM_KEY}
        """
    )


def rllm_config(backend_port: int, port: int, db_path: Path) -> str:
    """One vLLM worker (the instant engine's vLLM face); token ids and logprobs asked of
    it on every call, as the gateway does by default."""
    return textwrap.dedent(
        f"""
        host: 127.0.0.1
        port: {port}
        db_path: {db_path}
        store_worker: sqlite
        add_logprobs: true
        add_return_token_ids: true
        log_level: WARNING
        workers:
          - url: http://127.0.0.1:{backend_port}{VLLM_API}
            model_name: {MODEL}
        """
    )
