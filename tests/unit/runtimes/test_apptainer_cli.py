"""The apptainer runtime at its CLI boundary.

Apptainer is not installable on these machines, so these tests check the exact argvs the
runtime issues, against the stand-in `apptainer` in fake_apptainer.py placed on PATH. The
commands it runs are real node processes, so timeouts and kills are real.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from schemas.task import ApptainerRuntime, Resources
from services.runtimes import SandboxStartError, SandboxUnavailable, create_runtime
from services.runtimes.apptainer_backend import exec_argv, start_argv, stop_argv
from tests.unit.runtimes.support import FORKING_HARNESS, alive, leftovers

FAKE = Path(__file__).with_name("fake_apptainer.py")
SPEC = ApptainerRuntime(
    image="/images/tool.sif",
    network="none",
    env={"A": "1"},
    binds=["/data:/data:ro"],
    resources=Resources(cpus=2, memory_mb=512),
)


@pytest.fixture
def cli_log(tmp_path, monkeypatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "apptainer"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} "$@"\n')
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin")
    log = tmp_path / "cli.log"
    monkeypatch.setenv("FAKE_APPTAINER_LOG", str(log))
    return log


def calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_argv_builders_are_exact(tmp_path):
    sd = tmp_path / "sd"
    assert start_argv(SPEC, "polar-x", sd) == [
        "apptainer", "instance", "start", "--contain", "--writable-tmpfs", "--cleanenv",
        "--home", f"{sd}/home:/home/polar", "--bind", f"{sd}/workdir:/workspace",
        "--bind", "/data:/data:ro", "--net", "--network", "none",
        "--cpus", "2", "--memory", "512M", "--env", "A=1", "/images/tool.sif", "polar-x",
    ]  # fmt: skip
    assert exec_argv("polar-x", ["ls", "-l"], cwd="/workspace/sub", env={"B": "2", "A": "1"}) == [
        "apptainer", "exec", "--cleanenv", "--pwd", "/workspace/sub",
        "--env", "A=1", "--env", "B=2", "instance://polar-x", "ls", "-l",
    ]  # fmt: skip
    assert stop_argv("polar-x", force=False) == ["apptainer", "instance", "stop", "polar-x"]
    assert stop_argv("polar-x", force=True)[3] == "--force"
    host = ApptainerRuntime(image="docker://alpine:3")
    assert "--net" not in start_argv(host, "n", sd)


async def test_lifecycle_issues_exactly_these_commands(cli_log, tmp_path):
    rt = create_runtime(SPEC, "app-1", base_dir=tmp_path / "base")
    sd = tmp_path / "base" / "app-1-a0-main"
    await rt.start()
    r = await rt.exec("echo $A $CALL; pwd", env={"CALL": "2"})
    assert r.ok and r.stdout.decode() == f"1 2\n{sd}/workdir\n"
    await rt.stop()
    await rt.stop()
    start, created, executed, stopped = calls(cli_log)
    assert start == ["instance", "stop", "--force", "polar-app-1-a0-main"]
    assert created == start_argv(SPEC, "polar-app-1-a0-main", sd)[1:]
    exec_id = next(a for a in executed if a.startswith("POLAR_EXEC_ID="))
    assert re.fullmatch(r"POLAR_EXEC_ID=[0-9a-f]{16}", exec_id)
    assert executed == [
        "exec", "--cleanenv", "--pwd", "/workspace", "--env", "A=1", "--env", "CALL=2",
        "--env", exec_id, "--env", "POLAR_RUNTIME_ID=app-1-a0-main",
        "--env", "POLAR_SESSION_ID=app-1", "instance://polar-app-1-a0-main",
        "sh", "-c", "echo $A $CALL; pwd",
    ]  # fmt: skip
    assert stopped == ["instance", "stop", "polar-app-1-a0-main"]
    assert not sd.exists()


async def test_cancel_forces_the_stop_and_kills_exec_clients(cli_log, tmp_path):
    rt = create_runtime(SPEC, "app-2", base_dir=tmp_path)
    await rt.start()
    r = await rt.exec(FORKING_HARNESS, timeout=3.0, grace=0.2)  # forked in time under load
    assert r.timed_out and r.stdout == b"forked\n"
    pids = [int(p) for p in (tmp_path / "app-2-a0-main/workdir/pids").read_text().split()]
    assert len(pids) == 3 and not [p for p in pids if alive(p)]
    await rt.exec("sleep 1000 &")
    await rt.cancel()
    assert calls(cli_log)[-1] == ["instance", "stop", "--force", "polar-app-2-a0-main"]
    assert leftovers(rt.runtime_id) == []
    assert not (tmp_path / "app-2-a0-main").exists()


async def test_files_inside_binds_and_outside_them(cli_log, tmp_path):
    rt = create_runtime(ApptainerRuntime(image="x.sif"), "app-3", base_dir=tmp_path)
    async with rt:
        await rt.upload_file("in/work.txt", b"w")
        await rt.upload_file("/home/polar/.cfg", b"h")
        assert (tmp_path / "app-3-a0-main/workdir/in/work.txt").read_bytes() == b"w"
        assert await rt.download("/home/polar/.cfg") == b"h"
        before = len(calls(cli_log))
        # Outside the binds the bytes go through sh/cat inside the instance. With the
        # stand-in, "inside" is the node, so use a path under tmp_path.
        outside = tmp_path / "elsewhere" / "f.txt"
        await rt.upload_file(str(outside), b"via-cat", mode=0o600)
        assert outside.read_bytes() == b"via-cat"
        assert await rt.download(str(outside)) == b"via-cat"
        shipped = calls(cli_log)[before:]
        assert [c[-3:] for c in shipped] == [
            ['mkdir -p "$(dirname "$1")" && cat > "$1" && chmod 600 "$1"', "sh", str(outside)],
            ['cat "$1"', "sh", str(outside)],
        ]


async def test_failed_instance_start_is_a_start_error(cli_log, tmp_path):
    rt = create_runtime(ApptainerRuntime(image="x.sif"), "app-4", base_dir=tmp_path)
    (Path(str(cli_log)).parent / "bin" / "apptainer").write_text(
        "#!/bin/sh\necho boom >&2; exit 1\n"
    )
    with pytest.raises(SandboxStartError, match="boom"):
        await rt.start()
    assert rt.state == "stopped" and not (tmp_path / "app-4-a0-main").exists()


async def test_missing_cli_is_unavailable(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    rt = create_runtime(ApptainerRuntime(image="x.sif"), "app-5", base_dir=tmp_path)
    with pytest.raises(SandboxUnavailable, match="apptainer"):
        await rt.start()
