"""What the executor collects after a harness ran, on a real local runtime with real git:
the workdir diff leaves out each preset's own config/log paths, and those paths (under
the session's HOME) come back as the harness's logs."""

from __future__ import annotations

import dataclasses
import posixpath
import shutil

import msgspec
import pytest

from schemas.task import LocalRuntime, TaskRequest
from services.node import artifacts as A
from services.node.harnesses import CLI_PRESETS, default_registry
from services.runtimes.local_backend import LocalSandboxRuntime
from tests.unit.harnesses.support import context

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


@pytest.fixture
async def runtime(tmp_path):
    rt = LocalSandboxRuntime(
        LocalRuntime(), "t-0000", "t-0000-main", base_dir=tmp_path / "sessions"
    )
    await rt.start()
    yield rt
    await rt.stop()


def preset(name: str):
    return default_registry().create(name)


@pytest.mark.parametrize("name", sorted(CLI_PRESETS))
async def test_the_diff_leaves_out_the_presets_own_paths(runtime, name):
    harness = preset(name)
    assert harness.own_paths, f"{name} names no config/log paths of its own"
    await runtime.upload_file("src/app.py", b"print('before')\n")
    assert (await runtime.exec(A.baseline_command())).ok
    # what the agent did, and what the CLI wrote for itself inside the project
    await runtime.upload_file("src/app.py", b"print('after')\n")
    await runtime.upload_file("notes/new.txt", b"made by the agent\n")
    for own in harness.own_paths:
        await runtime.upload_file(posixpath.join(own, "state.json"), b'{"cli": "own"}\n')
    diff = await runtime.exec(A.diff_command(harness))
    assert diff.ok, diff.stderr
    text = diff.stdout.decode()
    assert "+print('after')" in text and "notes/new.txt" in text
    for own in harness.own_paths:
        assert own not in text, f"{name}'s {own} is in the diff"


@pytest.mark.parametrize("name", sorted(CLI_PRESETS))
async def test_the_presets_own_paths_come_back_as_logs(runtime, name):
    harness = preset(name)
    ctx = dataclasses.replace(
        context(), workdir=runtime.workdir, home=runtime.home, log_dir=f"{runtime.home}/.polar/logs"
    )
    await runtime.upload_file(posixpath.join(ctx.log_dir, "harness.json"), b'{"polar": 1}')
    for own in harness.own_paths:
        await runtime.upload_file(posixpath.join(ctx.home, own, "session.log"), b"cli log line\n")
    collected: dict[str, str] = {}
    for path in A.log_paths(harness, ctx):  # as the executor collects them
        tar = await runtime.download_tar(path)
        for member, text in A.untar_texts(tar, 1 << 16).items():
            collected[f"{path.rsplit('/', 1)[-1]}/{member}"] = text
    assert collected["logs/harness.json"] == '{"polar": 1}'
    for own in harness.own_paths:
        assert collected[f"{own.rsplit('/', 1)[-1]}/session.log"] == "cli log line\n"


def test_the_installed_version_is_read_from_the_collected_record():
    record = '{"harness": "codex", "version": "0.171.0", "source": "node_cache"}'
    assert A.installed_version({"logs/harness.json": record}) == "0.171.0"
    assert A.installed_version({}) is None  # no CLI install (shell), or nothing collected
    assert A.installed_version({"logs/harness.json": "{not json"}) is None
    assert A.installed_version({"logs/harness.json": "[1, 2]"}) is None


def task_of(**raw) -> TaskRequest:
    return msgspec.convert({"instruction": "x", **raw}, TaskRequest)


@pytest.mark.parametrize(
    ("raw", "taken"),
    [
        ({}, False),  # session_completed judges the outcome alone
        ({"evaluator": {"name": "exact_answer"}}, False),
        ({"evaluator": {"name": "test_on_output"}}, True),  # reads the workspace
        ({"evaluator": {"name": "command", "runtime": "fresh"}}, True),  # applies the diff
        ({"evaluator": {"name": "rubric"}}, True),  # its base evaluator may
        ({"evaluator": {"name": "tests.unit.evaluators.plugins:Jitter"}}, True),  # unknown
        ({"agent": {"harness": "noop", "collect_diff": True}}, True),
        (
            {
                "agent": {"harness": "noop", "collect_diff": False},
                "evaluator": {"name": "swebench"},
            },
            False,
        ),
    ],
)
def test_the_diff_is_taken_when_something_reads_it(raw, taken):
    assert A.takes_diff(task_of(**raw)) is taken
