"""Prepare actions against a real local runtime: uploads, exec retries with backoff, logs."""

from __future__ import annotations

import json

import msgspec
import pytest

from schemas.task import ExecAction, LocalRuntime, UploadDir, UploadFile
from services.runtimes import backoff_delay, create_runtime, run_prepare

# Fails on its first two runs, succeeds on the third (the counter lives in the workdir).
FLAKY = (
    'n=$(cat count 2>/dev/null || echo 0); n=$((n+1)); echo $n > count; echo "try $n"; [ $n -ge 3 ]'
)


@pytest.fixture
async def rt(tmp_path):
    runtime = create_runtime(LocalRuntime(), "prep-1", base_dir=tmp_path)
    await runtime.start()
    yield runtime
    await runtime.stop()


class RecordedSleep:
    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


def test_backoff_doubles_and_is_capped():
    assert [backoff_delay(0.5, i) for i in range(4)] == [0.5, 1.0, 2.0, 4.0]
    assert backoff_delay(100, 5) == 300.0


async def test_exec_retries_with_backoff_until_it_succeeds(rt, tmp_path):
    sleep = RecordedSleep()
    action = ExecAction(command=FLAKY, retries=3, backoff_seconds=0.25)
    (log,) = await run_prepare(rt, [action], log_dir=tmp_path / "logs", sleep=sleep)
    assert log.ok and log.action == "exec" and len(log.attempts) == 3
    assert [a.ok for a in log.attempts] == [False, False, True]
    assert [a.exit_code for a in log.attempts] == [1, 1, 0]
    assert [a.stdout for a in log.attempts] == ["try 1\n", "try 2\n", "try 3\n"]
    assert sleep.delays == [0.25, 0.5]
    written = json.loads((tmp_path / "logs/prepare-00-exec.json").read_bytes())
    assert written["ok"] is True and len(written["attempts"]) == 3


async def test_real_backoff_sleeps(rt):
    action = ExecAction(command=FLAKY, retries=2, backoff_seconds=0.05)
    (log,) = await run_prepare(rt, [action])
    assert log.ok and log.duration >= 0.05 + 0.1


async def test_failure_after_retries_stops_the_sequence(rt):
    sleep = RecordedSleep()
    actions = [
        ExecAction(command="echo nope >&2; exit 7", retries=1, backoff_seconds=1),
        UploadFile(dest="never.txt", content="x"),
    ]
    logs = await run_prepare(rt, actions, sleep=sleep)
    assert len(logs) == 1 and not logs[0].ok
    assert [a.stderr for a in logs[0].attempts] == ["nope\n", "nope\n"]
    assert sleep.delays == [1]
    assert not (await rt.exec("test -e never.txt")).ok


async def test_exec_timeout_is_logged_as_a_failed_attempt(rt):
    (log,) = await run_prepare(rt, [ExecAction(command="sleep 30", timeout_seconds=0.3)])
    assert not log.ok and log.attempts[0].timed_out


async def test_uploads_then_exec_see_the_files(rt, tmp_path):
    src = tmp_path / "repo"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("X = 1\n")
    node_file = tmp_path / "node.txt"
    node_file.write_text("from node")
    actions = [
        UploadFile(dest="task.md", content="do it", mode=0o600),
        UploadFile(dest="conf/node.txt", src=str(node_file)),
        UploadDir(src=str(src), dest="repo"),
        ExecAction(
            command=["sh", "-c", "cat task.md conf/node.txt repo/pkg/mod.py"], env={"A": "1"}
        ),
    ]
    logs = await run_prepare(rt, actions, log_dir=tmp_path / "logs")
    assert [(log.action, log.ok) for log in logs] == [
        ("upload_file", True), ("upload_file", True), ("upload_dir", True), ("exec", True),
    ]  # fmt: skip
    assert logs[3].attempts[0].stdout == "do itfrom nodeX = 1\n"
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "prepare-00-upload_file.json", "prepare-01-upload_file.json",
        "prepare-02-upload_dir.json", "prepare-03-exec.json",
    ]  # fmt: skip


async def test_failed_upload_is_data_not_an_exception(rt, tmp_path):
    logs = await run_prepare(rt, [UploadDir(src=str(tmp_path / "missing"))])
    assert not logs[0].ok and "not a directory" in (logs[0].attempts[0].error or "")
    round_trip = msgspec.json.decode(msgspec.json.encode(logs[0]))
    assert round_trip["attempts"][0]["ok"] is False


async def test_a_step_asks_for_the_network_and_the_runtime_is_told(tmp_path, monkeypatch):
    """``network: true`` on an exec step reaches the runtime's exec (bubblewrap runs it
    without ``--unshare-net``: tests/integration/test_runtime_bwrap.py); off by default."""
    seen = []
    rt = create_runtime(LocalRuntime(sandbox="none"), "s-net", base_dir=tmp_path)
    real = rt.exec

    async def exec_(cmd, **kw):
        seen.append(kw["network"])
        return await real(cmd, **kw)

    monkeypatch.setattr(rt, "exec", exec_)
    steps = msgspec.convert(
        [{"action": "exec", "command": "true", "network": True},
         {"action": "exec", "command": "true"}],
        list[ExecAction],
    )  # fmt: skip
    async with rt:
        logs = await run_prepare(rt, steps)
    assert [a.ok for step in logs for a in step.attempts] == [True, True]
    assert seen == [True, False]


def test_a_local_runtime_refuses_a_bridge_network_at_submission():
    with pytest.raises(msgspec.ValidationError, match="network"):
        msgspec.convert({"backend": "local", "network": "bridge"}, LocalRuntime)
