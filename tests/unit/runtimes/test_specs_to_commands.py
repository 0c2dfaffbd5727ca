"""Pure translations: specs -> bwrap argv, docker create arguments, factory dispatch."""

from __future__ import annotations

import sys
from pathlib import Path

import docker.errors
import pytest
import requests

from schemas.task import ApptainerRuntime, DockerRuntime, LocalRuntime, Resources
from services.runtimes import (
    RUNTIME_FACTORIES,
    SandboxConfigError,
    SandboxError,
    SandboxIOError,
    SandboxStartError,
    SandboxUnavailable,
    create_runtime,
    runtime_id_for,
)
from services.runtimes.apptainer_backend import ApptainerSandboxRuntime
from services.runtimes.bridge import inside_proxy_url, proxy_address
from services.runtimes.bwrap import BRIDGE_SOCKET_INSIDE, bridge_prefix, bwrap_argv, checkout_root
from services.runtimes.docker_backend import DockerSandboxRuntime, create_kwargs, translated
from services.runtimes.docker_exec import deadline_argv, stdin_argv, sweep_argv
from services.runtimes.local_backend import LocalSandboxRuntime


@pytest.fixture
def no_private_dirs(monkeypatch):
    """The argv without this host's private places (which differ between hosts)."""
    monkeypatch.setattr("services.runtimes.bwrap.PRIVATE_DIRS", ())
    monkeypatch.setattr("services.runtimes.bwrap.SECRET_FILES", ())
    monkeypatch.setattr("services.runtimes.bwrap.checkout_root", lambda: None)


def test_bwrap_argv_isolated_network_with_bridge(monkeypatch, no_private_dirs):
    monkeypatch.setattr("services.runtimes.bwrap.host_paths_needed_inside", lambda: ["/usr/x"])
    argv = bwrap_argv(session_dir="/s/x", cwd="/s/x/workdir", isolate_network=True,
                      bridge_socket="/tmp/b/proxy.sock")  # fmt: skip
    assert argv == [
        "bwrap", "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc",
        "--unshare-uts", "--cap-drop", "ALL", "--unshare-net",
        "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
        "--tmpfs", "/run", "--bind", "/s/x", "/s/x",
        "--bind", "/tmp/b/proxy.sock", BRIDGE_SOCKET_INSIDE, "--chdir", "/s/x/workdir", "--",
    ]  # fmt: skip


def test_bwrap_argv_binds_back_masked_host_paths(monkeypatch, no_private_dirs):
    """A checkout or venv under /tmp (as CI's clones are) stays visible in the sandbox."""
    paths = ["/tmp/ci/.venv", "/run/x", "/usr/lib/python3.11"]
    monkeypatch.setattr("services.runtimes.bwrap.host_paths_needed_inside", lambda: paths)
    argv = bwrap_argv(session_dir="/s/x", cwd="/s/x", isolate_network=True)
    tail = argv[argv.index("/run") + 1 :]
    assert tail[:6] == [
        "--ro-bind",
        "/tmp/ci/.venv",
        "/tmp/ci/.venv",
        "--ro-bind",
        "/run/x",
        "/run/x",
    ]
    assert "/usr/lib/python3.11" not in argv  # visible anyway under the read-only /
    host = bwrap_argv(session_dir="/s/x", cwd="/s/x", isolate_network=False)
    assert "/run/x" not in host and "/tmp/ci/.venv" in host


def test_bwrap_argv_masks_private_places_and_other_sessions(monkeypatch, tmp_path):
    """Issue 17: inside bubblewrap /root, /work and /etc/shadow were readable."""
    home, sessions, cache = tmp_path / "root", tmp_path / "sessions", tmp_path / "root" / "cache"
    for d in (home / "inner", sessions / "mine", cache):
        d.mkdir(parents=True)
    shadow = tmp_path / "shadow"
    shadow.write_text("root:x")
    monkeypatch.setattr("services.runtimes.bwrap.PRIVATE_DIRS", (str(home), str(home / "inner")))
    monkeypatch.setattr("services.runtimes.bwrap.SECRET_FILES", (str(shadow), "/nonexistent"))
    monkeypatch.setattr("services.runtimes.bwrap.host_paths_needed_inside", lambda: [])
    mine = str(sessions / "mine")
    argv = bwrap_argv(
        session_dir=mine, cwd=mine, isolate_network=False, hide=(str(sessions),),
        expose=(str(cache),),
    )  # fmt: skip
    pairs = list(zip(argv, argv[1:], strict=False))
    assert ("--tmpfs", str(home)) in pairs and ("--tmpfs", str(sessions)) in pairs
    assert ("--tmpfs", str(home / "inner")) not in pairs  # inside a masked one already
    assert argv[argv.index(str(shadow)) - 2 :][:3] == ["--ro-bind", "/dev/null", str(shadow)]
    assert "/nonexistent" not in argv
    binds = [argv[i + 1] for i, a in enumerate(argv) if a in ("--ro-bind", "--bind")]
    assert binds.index(str(cache)) < binds.index(mine)  # bound back after the masks
    assert argv.index("--tmpfs") < argv.index(str(cache))


def test_bwrap_argv_masks_this_checkout_wherever_it_lives(monkeypatch, no_private_dirs, tmp_path):
    """CI's clone at /check/work/main was readable: only /work was masked. The checkout is
    masked by where it is; its venv and the bridge script come back read-only."""
    checkout = tmp_path / "check" / "main"
    venv, runtimes = checkout / ".venv", checkout / "services" / "runtimes"
    for d in (venv, runtimes):
        d.mkdir(parents=True)
    monkeypatch.setattr("services.runtimes.bwrap.checkout_root", lambda: str(checkout))
    monkeypatch.setattr(
        "services.runtimes.bwrap.host_paths_needed_inside", lambda: [str(venv), str(runtimes)]
    )
    argv = bwrap_argv(session_dir="/s/x", cwd="/s/x", isolate_network=False)
    pairs = list(zip(argv, argv[1:], strict=False))
    mask = argv.index(str(checkout))
    assert argv[mask - 1] == "--tmpfs"
    assert all(
        argv.index(str(p)) > mask and ("--ro-bind", str(p)) in pairs for p in (venv, runtimes)
    )


def test_checkout_root_is_this_source_tree():
    root = checkout_root()
    assert root is not None and Path(root, "services", "runtimes", "bwrap.py").is_file()


def test_bwrap_argv_host_network_keeps_run():
    argv = bwrap_argv(session_dir="/s/x", cwd="/s/x", isolate_network=False)
    assert "--unshare-net" not in argv and "/run" not in argv and "--unshare-pid" in argv


def test_bridge_prefix_runs_the_inner_script_with_the_host_interpreter():
    prefix = bridge_prefix(8123)
    assert prefix[:4] == [sys.executable, "-I", "-S", prefix[3]]
    assert prefix[3].endswith("services/runtimes/bridge_inner.py")
    assert prefix[4:] == ["8123", BRIDGE_SOCKET_INSIDE]


def test_proxy_urls_through_the_bridge():
    assert proxy_address("http://10.0.0.5:9000/s/tok") == ("10.0.0.5", 9000)
    assert inside_proxy_url("http://10.0.0.5:9000/s/tok") == "http://127.0.0.1:9000/s/tok"
    assert inside_proxy_url("http://proxy/v1") == "http://127.0.0.1:80/v1"
    with pytest.raises(SandboxConfigError, match="http://"):
        proxy_address("https://proxy:443")


def test_docker_create_kwargs_map_limits_network_and_mounts():
    spec = DockerRuntime(image="img:1", network="none", env={"A": "1"},
                         resources=Resources(cpus=1.5, memory_mb=256),
                         mounts=["/data:/data:ro"], workdir="/w")  # fmt: skip
    kw = create_kwargs(spec, "s-1-main", "s-1")
    assert kw["image"] == "img:1" and kw["name"] == "polar-s-1-main"
    assert kw["labels"] == {"polar.runtime": "s-1-main", "polar.session": "s-1"}
    assert (kw["nano_cpus"], kw["mem_limit"], kw["network_mode"]) == (1_500_000_000, "256m", "none")
    assert kw["volumes"] == ["/data:/data:ro"] and kw["working_dir"] == "/w"
    assert kw["environment"] == {"A": "1"}
    assert "nano_cpus" not in create_kwargs(DockerRuntime(image="i"), "r", "s")


def test_docker_exec_wrappers():
    assert deadline_argv(["a"], None) == ["a"]
    assert deadline_argv(["a", "b"], 10.5) == ["timeout", "-s", "KILL", "15", "a", "b"]
    assert stdin_argv(["cat"], "/tmp/in")[3:] == ["/tmp/in", "cat"]
    argv = sweep_argv("POLAR_EXEC_ID=ab", 0.5)
    assert argv[:2] == ["sh", "-c"] and argv[3:] == ["sweep", "POLAR_EXEC_ID=ab", "5"]


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (docker.errors.ImageNotFound("no such image"), SandboxStartError),
        (docker.errors.NotFound("gone"), SandboxIOError),
        (docker.errors.APIError("500"), SandboxIOError),
        (requests.ConnectionError("refused"), SandboxUnavailable),
        (docker.errors.DockerException("cannot connect"), SandboxUnavailable),
    ],
)
def test_docker_exceptions_are_translated_once(raised, expected):
    with pytest.raises(expected) as caught, translated("download x", SandboxIOError):
        raise raised
    assert caught.value.__cause__ is raised and "download x" in str(caught.value)


async def test_unreachable_docker_engine_is_unavailable(tmp_path):
    rt = create_runtime(DockerRuntime(image="img"), "s-9", base_dir=tmp_path,
                        docker_host=f"unix://{tmp_path}/no.sock")  # fmt: skip
    with pytest.raises(SandboxUnavailable) as caught:
        await rt.start()
    assert caught.value.retryable and rt.state == "stopped"


def test_factory_dispatches_on_spec_type(tmp_path):
    assert set(RUNTIME_FACTORIES) == {LocalRuntime, DockerRuntime, ApptainerRuntime}
    pairs = [(LocalRuntime(), LocalSandboxRuntime), (DockerRuntime(image="i"), DockerSandboxRuntime),
             (ApptainerRuntime(image="i.sif"), ApptainerSandboxRuntime)]  # fmt: skip
    for spec, cls in pairs:
        rt = create_runtime(spec, "t-1-0001", base_dir=tmp_path, attempt=2, role="eval")
        assert type(rt) is cls and rt.runtime_id == "t-1-0001-a2-eval" and rt.state == "new"
    with pytest.raises(SandboxConfigError):
        create_runtime("not a spec", "s", base_dir=tmp_path)  # type: ignore[arg-type]
    with pytest.raises(SandboxConfigError, match="role"):
        runtime_id_for("s", 0, "Bad Role")


def test_errors_carry_the_runtime_id():
    err = SandboxError("boom", runtime_id="s-1-main")
    assert str(err) == "[s-1-main] boom" and not err.retryable


def test_sandbox_auto_puts_every_harness_that_runs_something_in_bubblewrap():
    """Issue 17: the default runtime ran harnesses with `sandbox: none` (point 11: the shell
    harness one session poisoning another); now only the noop harness, which runs nothing."""
    from services.runtimes.factory import default_sandbox

    auto = LocalRuntime()
    assert auto.sandbox == "auto"
    assert default_sandbox(auto, "codex", bwrap_installed=True) == "bwrap"
    assert default_sandbox(auto, "claude_code", bwrap_installed=False) == "none"  # + warning
    assert default_sandbox(auto, "shell", bwrap_installed=True) == "bwrap"
    assert default_sandbox(auto, "mypkg.h:Harness", bwrap_installed=True) == "bwrap"
    assert default_sandbox(auto, "noop", bwrap_installed=True) == "none"  # runs nothing
    assert default_sandbox(auto, "shell", bwrap_installed=False) == "none"  # + warning
    assert default_sandbox(LocalRuntime(network="none"), "shell", bwrap_installed=True) == "bwrap"
    assert default_sandbox(LocalRuntime(sandbox="none"), "codex", bwrap_installed=True) is None


def test_a_preset_without_bubblewrap_is_warned_about_loudly(monkeypatch, caplog):
    from services.runtimes import factory

    monkeypatch.setattr(factory.shutil, "which", lambda _: None)
    monkeypatch.setattr(factory, "_warned", set())
    spec = factory.with_default_sandbox(LocalRuntime(), "gemini_cli")
    assert spec.sandbox == "none"
    assert "NO SANDBOX: harness 'gemini_cli'" in caplog.text
    assert factory.with_default_sandbox(LocalRuntime(), "codex").sandbox == "none"
