"""A CLI preset end to end on a real local runtime: install from the node's cache, link,
configure, run (the CLI is a tiny npm package that prints what it was given)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from schemas.task import LocalRuntime
from services.node.harnesses.base import HarnessContext
from services.node.harnesses.cli import CliHarness, Variant
from services.node.harnesses.npm import NpmPackage, ensure_installed
from services.runtimes.base import OutputBuffer
from services.runtimes.local_backend import LocalSandboxRuntime
from tests.helpers.requires import requires_npm
from tests.unit.harnesses.support import TOKEN, context, fake_cli_tarball

pytestmark = requires_npm


class FakeCli(CliHarness):
    name = "fake"
    package = "polar-fake-cli"
    default_version = "1.0.0"
    bin = "fakecli"
    own_paths = (".fake",)
    variants = (Variant("chat", "openai_chat"),)
    tarball = ""

    def npm_package(self, version: str) -> NpmPackage:
        return NpmPackage(self.package, version, self.bin, source=self.tarball)

    def config_files(self, ctx: HarnessContext, variant: Variant) -> dict[str, bytes]:
        return {".fake/config.json": json.dumps({"url": ctx.openai_base_url}).encode()}

    def command(self, ctx: HarnessContext, variant: Variant):
        return ["--model", ctx.agent.model], [ctx.instruction]


@pytest.fixture
async def runtime(tmp_path, monkeypatch):
    monkeypatch.delenv("POLAR_HARNESS_CACHE", raising=False)
    rt = LocalSandboxRuntime(
        LocalRuntime(), "t-0000", "t-0000-main", base_dir=tmp_path / "sessions"
    )
    await rt.start()
    yield rt
    await rt.stop()


async def test_install_configure_run_on_a_local_runtime(tmp_path, runtime):
    harness = FakeCli()
    harness.tarball = str(fake_cli_tarball(tmp_path / "pkg"))
    ctx = context(harness="fake", args=["--flag"], env={"EXTRA": "yes"})
    ctx = dataclasses.replace(ctx, workdir=runtime.workdir, home=runtime.home)

    await harness.install(runtime, ctx)
    await harness.configure(runtime, ctx)
    cache = tmp_path / "harness-cache"  # <work_dir>/harness-cache: sessions/ sits beside it
    assert (cache / "polar-fake-cli-1.0.0" / "node_modules" / ".bin" / "fakecli").exists()
    record = json.loads(await runtime.download(f"{runtime.home}/.polar/logs/harness.json"))
    assert record["version"] == "1.0.0" and record["source"] == "node_cache"
    assert record["cached"] is False and record["protocol"] == "openai_chat"
    config = json.loads(await runtime.download(f"{runtime.home}/.fake/config.json"))
    assert config["url"].endswith(f"/s/{TOKEN}/v1")

    run = harness.run(ctx)
    out = OutputBuffer()
    proc = await runtime.spawn(run.argv, cwd=run.cwd, env=run.env, stdout=out)
    status = await proc.wait(60)
    assert status.exit_code == 0
    seen = json.loads(out.data())
    assert seen["argv"] == ["--model", "m-1", "--flag", "Fix the bug."]
    assert seen["cwd"] == runtime.workdir and seen["key"] == TOKEN and seen["extra"] == "yes"
    assert seen["path0"] == f"{runtime.home}/.polar/bin"
    assert harness.version(ctx) == "1.0.0" and harness.protocol == "openai_chat"

    second = FakeCli()  # the next session on this node finds the CLI in the cache
    second.tarball = harness.tarball
    await second.install(runtime, ctx)
    record = json.loads(await runtime.download(f"{runtime.home}/.polar/logs/harness.json"))
    assert record["cached"] is True and record["install_seconds"] < 0.5


async def test_a_read_only_preinstalled_dir_is_used_as_it_is(tmp_path, runtime):
    """CLIs pre-installed in the cache layout (``polar``'s preinstall, mounted read-only
    into containers) run from there: nothing is installed or written for the session."""
    harness = FakeCli()
    harness.tarball = str(fake_cli_tarball(tmp_path / "pkg"))
    ro = tmp_path / "ro"
    await ensure_installed(ro, harness.npm_package(harness.default_version))
    for path in [ro, *ro.rglob("*")]:  # read-only, as the mount would be
        if not path.is_symlink():
            path.chmod(path.stat().st_mode & ~0o222)
    before = sorted(str(p) for p in ro.rglob("*"))
    ctx = context(harness="fake", settings={"install_dir": str(ro)})
    ctx = dataclasses.replace(ctx, workdir=runtime.workdir, home=runtime.home)
    try:
        await harness.install(runtime, ctx)
        await harness.configure(runtime, ctx)
        record = json.loads(await runtime.download(f"{runtime.home}/.polar/logs/harness.json"))
        assert record["source"] == "install_dir" and record["cached"] is True
        run = harness.run(ctx)
        out = OutputBuffer()
        proc = await runtime.spawn(run.argv, cwd=run.cwd, env=run.env, stdout=out)
        assert (await proc.wait(60)).exit_code == 0
        assert json.loads(out.data())["argv"][-1] == "Fix the bug."
        assert sorted(str(p) for p in ro.rglob("*")) == before
        assert not (tmp_path / "harness-cache").exists()  # the node cache was not used
    finally:
        for path in [ro, *ro.rglob("*")]:  # let pytest clean it up
            if not path.is_symlink():
                path.chmod(path.stat().st_mode | 0o200)


async def test_preinstalled_dir_is_checked_not_installed(tmp_path, runtime):
    ctx = context(harness="fake", settings={"install_dir": str(tmp_path / "ro")})
    ctx = dataclasses.replace(ctx, workdir=runtime.workdir, home=runtime.home)
    with pytest.raises(Exception, match="is not pre-installed at"):
        await FakeCli().install(runtime, ctx)
