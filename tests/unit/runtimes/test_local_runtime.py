"""The local runtime without bubblewrap: real processes in a per-session directory."""

from __future__ import annotations

import asyncio
import io
import os
import tarfile
import time

import pytest

from schemas.task import LocalRuntime
from services.runtimes import (
    RuntimeStopped,
    SandboxConfigError,
    SandboxError,
    SandboxExecError,
    SandboxIOError,
    adopt_runtime,
    create_runtime,
)
from tests.unit.runtimes.support import FORKING_HARNESS, alive, leftovers, settled_leftovers


@pytest.fixture
async def rt(tmp_path):
    runtime = create_runtime(LocalRuntime(env={"SPEC_VAR": "from-spec"}), "s-1", base_dir=tmp_path)
    await runtime.start()
    yield runtime
    await runtime.stop()


async def test_exec_runs_in_workdir_with_built_env(rt, tmp_path):
    r = await rt.exec('echo "$SPEC_VAR $CALL_VAR"; pwd; echo "$HOME"', env={"CALL_VAR": "call"})
    lines = r.stdout.decode().splitlines()
    assert r.ok and r.exit_code == 0 and not r.timed_out
    assert lines == ["from-spec call", rt.workdir, rt.home]
    assert rt.workdir == str(tmp_path / "s-1-a0-main" / "workdir")


async def test_host_secrets_are_not_inherited(rt, monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "do-not-leak")
    r = await rt.exec("env")
    assert b"SECRET_TOKEN" not in r.stdout
    assert b"POLAR_RUNTIME_ID=s-1-a0-main" in r.stdout


async def test_exec_argv_cwd_stdin_and_exit_code(rt):
    await rt.exec("mkdir -p sub")
    r = await rt.exec(["sh", "-c", "pwd; cat; exit 3"], cwd="sub", stdin=b"piped")
    assert r.exit_code == 3 and not r.ok
    assert r.stdout.decode() == f"{rt.workdir}/sub\npiped"


async def test_missing_binary_is_a_sandbox_exec_error(rt):
    with pytest.raises(SandboxExecError, match="no-such-binary"):
        await rt.exec(["no-such-binary-xyz"])


async def test_timeout_kills_forked_children_and_setsid_grandchild(rt, tmp_path):
    started = time.monotonic()
    # the harness must fork its three and say so before the timeout: 3 s lets a loaded
    # machine do that, and the kill still comes well before the sleeps' 1000 s
    r = await rt.exec(FORKING_HARNESS, timeout=3.0, grace=0.3)
    assert r.timed_out and r.stdout == b"forked\n"
    assert time.monotonic() - started < 8
    pids = [int(p) for p in (tmp_path / "s-1-a0-main/workdir/pids").read_text().split()]
    assert len(pids) == 3
    assert not [p for p in pids if alive(p)]
    assert leftovers(rt.runtime_id) == []


async def test_spawn_streams_output_and_wait_timeout_kills_tree(rt):
    chunks: list[bytes] = []
    proc = await rt.spawn(
        "echo one; sleep 0.2; echo two; sleep 1000 & sleep 1000", stdout=chunks.append
    )
    status = await proc.wait(timeout=2.0, grace=0.2)  # "two" is due after 0.2 s
    assert status.timed_out and status.exit_code == 128 + 15
    assert b"".join(chunks) == b"one\ntwo\n"
    assert leftovers(rt.runtime_id) == []


async def test_kill_is_idempotent_and_hits_background_children(rt):
    proc = await rt.spawn("sleep 1000 & sleep 1000")
    await settled_leftovers(rt.runtime_id, 3)  # the children are there to be hit
    await proc.kill()
    await proc.kill()
    status = await proc.wait(timeout=10)  # already killed: returns at once
    assert status.killed and status.exit_code == 128 + 9
    assert leftovers(rt.runtime_id) == []


async def test_exec_returns_while_a_background_child_holds_stdout(rt):
    r = await rt.exec("sleep 1000 & echo started", timeout=5)
    assert r.ok and r.stdout == b"started\n" and r.duration < 4  # not the 5 s timeout
    assert len(await settled_leftovers(rt.runtime_id, 1)) == 1  # the daemon lives until stop


async def test_stop_kills_everything_removes_dir_and_is_idempotent(tmp_path):
    rt = create_runtime(LocalRuntime(), "s-2", base_dir=tmp_path)
    await rt.start()
    await rt.exec("setsid sleep 1000 & sleep 1000 &")
    assert len(await settled_leftovers(rt.runtime_id, 2)) == 2
    await rt.stop(grace=0.2)
    await rt.stop()
    await rt.cancel()
    assert rt.state == "stopped"
    assert leftovers(rt.runtime_id) == []
    assert not (tmp_path / "s-2-a0-main").exists()
    with pytest.raises(RuntimeStopped):
        await rt.exec("true")


async def test_stopping_after_a_run_scans_proc_once(tmp_path, monkeypatch):
    """The stop of a runtime whose processes all exited (the harness spawned, waited for)
    reads /proc once for all of them; one with a live setsid escapee still kills it. A
    first attempt's start reads it not at all."""
    from services.runtimes import procs

    scans: list[str] = []
    scan = procs.tagged_pids
    monkeypatch.setattr(procs, "tagged_pids", lambda n, v: scans.append(v) or scan(n, v))
    rt = create_runtime(LocalRuntime(), "s-2b", base_dir=tmp_path)
    await rt.start(first_attempt=True)  # nothing of this id can be left: no scan
    assert scans == []
    proc = await rt.spawn("true")
    await proc.wait(5)
    scans.clear()
    await rt.stop(grace=0.5)
    assert scans == [rt.runtime_id]
    escaped = create_runtime(LocalRuntime(), "s-2c", base_dir=tmp_path)
    await escaped.start()  # a retry's: a crashed attempt's processes are looked for
    assert scans[-1] == escaped.runtime_id
    proc = await escaped.spawn("setsid sleep 1000 & echo go; wait")
    assert len(await settled_leftovers(escaped.runtime_id, 2)) == 2
    await escaped.stop(grace=0.2)
    assert leftovers(escaped.runtime_id) == [] and (await proc.wait(5)).killed


async def test_cancel_during_exec(tmp_path):
    rt = create_runtime(LocalRuntime(), "s-3", base_dir=tmp_path)
    await rt.start()
    running = asyncio.create_task(rt.exec(FORKING_HARNESS, timeout=60))
    while not (tmp_path / "s-3-a0-main/workdir/pids").exists():
        await asyncio.sleep(0.02)
    started = time.monotonic()
    await rt.cancel()
    with pytest.raises(RuntimeStopped):
        await running
    assert time.monotonic() - started < 6  # not the exec's 60 s
    assert rt.state == "cancelled"
    assert leftovers(rt.runtime_id) == []
    assert not (tmp_path / "s-3-a0-main").exists()


async def test_stop_before_start_and_no_restart(tmp_path):
    rt = create_runtime(LocalRuntime(), "s-4", base_dir=tmp_path)
    await rt.stop()
    assert rt.state == "stopped"
    with pytest.raises(SandboxError, match="cannot start a stopped runtime"):
        await rt.start()


async def test_start_clears_a_crashed_runs_leftovers(tmp_path):
    stale = tmp_path / "s-5-a0-main" / "workdir"
    stale.mkdir(parents=True)
    (stale / "old.txt").write_text("stale")
    rt = create_runtime(LocalRuntime(), "s-5", base_dir=tmp_path)
    async with rt:
        assert (await rt.exec("ls")).stdout == b""


async def test_upload_download_round_trips(rt, tmp_path):
    await rt.upload_file("a/b/c.txt", b"hello", mode=0o600)
    assert await rt.download("a/b/c.txt") == b"hello"
    assert oct(os.stat(f"{rt.workdir}/a/b/c.txt").st_mode & 0o777) == "0o600"
    src = tmp_path / "src"
    (src / "nested").mkdir(parents=True)
    (src / "top.txt").write_text("top")
    (src / "nested" / "deep.txt").write_text("deep")
    await rt.upload_dir(src, "copied")
    assert (await rt.exec("cat copied/top.txt copied/nested/deep.txt")).stdout == b"topdeep"
    with tarfile.open(fileobj=io.BytesIO(await rt.download_tar("copied"))) as tar:
        names = sorted(tar.getnames())
    assert names == ["nested", "nested/deep.txt", "top.txt"]
    node_file = tmp_path / "node.bin"
    node_file.write_bytes(b"\x00\x01")
    await rt.upload_file("/".join([rt.home, "x.bin"]), src=node_file)
    assert await rt.download(f"{rt.home}/x.bin") == b"\x00\x01"


async def test_paths_outside_the_session_are_refused(rt):
    with pytest.raises(SandboxIOError, match="outside"):
        await rt.upload_file("/etc/polar-test", b"x")
    with pytest.raises(SandboxIOError, match="outside"):
        await rt.download("../../../../etc/hostname")
    # A symlink planted inside the sandbox cannot redirect a write or a read.
    await rt.exec("ln -s /etc/hostname planted")
    with pytest.raises(SandboxIOError, match="outside"):
        await rt.upload_file("planted", b"x")
    with pytest.raises(SandboxIOError, match="outside"):
        await rt.download("planted")
    with pytest.raises(SandboxIOError):
        await rt.download("missing.txt")
    # A sibling whose name starts with the session directory's is outside it too.
    sibling = f"{rt.session_dir}-sibling"
    assert (await rt.exec(f"mkdir {sibling} && echo x > {sibling}/f")).ok
    with pytest.raises(SandboxIOError, match="outside"):
        await rt.download(f"{sibling}/f")
    await rt.exec(f"ln -s {sibling} planted-dir")
    with pytest.raises(SandboxIOError, match="outside"):
        await rt.download("planted-dir/f")


def test_network_none_needs_bwrap(tmp_path):
    with pytest.raises(SandboxConfigError, match="bwrap"):
        create_runtime(LocalRuntime(sandbox="none", network="none"), "s-6", base_dir=tmp_path)
    with pytest.raises(SandboxConfigError, match="bridge"):
        create_runtime(LocalRuntime(network="bridge"), "s-6", base_dir=tmp_path)


async def test_detach_then_adopt_hands_the_sandbox_over(tmp_path):
    spec = LocalRuntime(env={"SPEC_VAR": "v"})
    pool_side = create_runtime(spec, "s-7", base_dir=tmp_path)
    await pool_side.start()
    await pool_side.upload_file("prepared.txt", b"ready")
    await pool_side.exec("sleep 1000 > /dev/null 2>&1 &")  # a service started by prepare
    await pool_side.detach()
    await pool_side.stop()  # a detached object no longer owns the sandbox: no-op
    assert pool_side.state == "detached"
    assert len(await settled_leftovers("s-7-a0-main", 1)) == 1
    with pytest.raises(RuntimeStopped):
        await pool_side.exec("true")

    executor_side = adopt_runtime(spec, "s-7", "s-7-a0-main", base_dir=tmp_path)
    assert executor_side.state == "running" and executor_side.workdir == pool_side.workdir
    r = await executor_side.exec("cat prepared.txt; echo $SPEC_VAR")
    assert r.stdout == b"readyv\n"
    await executor_side.stop(grace=0.2)
    assert leftovers("s-7-a0-main") == []
    assert not (tmp_path / "s-7-a0-main").exists()


async def test_adopting_what_a_dead_process_left_cleans_it_up(tmp_path):
    abandoned = create_runtime(LocalRuntime(), "s-8", base_dir=tmp_path)
    await abandoned.start()
    await abandoned.exec("setsid sleep 1000 > /dev/null 2>&1 &")
    del abandoned  # its process died: nobody stops it
    assert len(await settled_leftovers("s-8-a0-main", 1)) == 1
    await adopt_runtime(LocalRuntime(), "s-8", "s-8-a0-main", base_dir=tmp_path).stop()
    assert await settled_leftovers("s-8-a0-main", 0) == []  # a killed process may linger a moment
    assert not (tmp_path / "s-8-a0-main").exists()


async def test_a_closed_pipe_keeps_what_was_written_before_it_closed():
    # A timeout kill closes the harness's pipes; output written just before it that the
    # event loop had not read yet was lost with them (test_node_timeout under load: an
    # empty stdout_tail though the harness had printed).
    from services.runtimes import OutputBuffer
    from services.runtimes.local_process import _PipeReader

    got = OutputBuffer()
    read_end, write_end = os.pipe()
    reader = _PipeReader(read_end, got)
    os.write(write_end, b"published\n")
    reader.close()  # no await: the loop never ran the reader's callback
    os.close(write_end)
    assert got.data() == b"published\n" and reader.done.done()
