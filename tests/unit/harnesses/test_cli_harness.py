"""A CLI preset end to end on a real local runtime: install from the node's cache, link,
configure, run (the CLI is a tiny npm package that prints what it was given)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from schemas.task import LocalRuntime
from services.executor.harnesses.base import HarnessContext
from services.executor.harnesses.cli import CliHarness, Variant
from services.executor.harnesses.npm import NpmPackage
from services.runtimes.base import OutputBuffer
from services.runtimes.local_backend import LocalSandboxRuntime
from tests.unit.harnesses.support import TOKEN, context, fake_cli_tarball

pytestmark = pytest.mark.skipif(shutil.which("npm") is None, reason="needs npm")


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


async def test_preinstalled_dir_is_checked_not_installed(tmp_path, runtime):
    ctx = context(harness="fake", settings={"install_dir": str(tmp_path / "ro")})
    ctx = dataclasses.replace(ctx, workdir=runtime.workdir, home=runtime.home)
    with pytest.raises(Exception, match="is not pre-installed at"):
        await FakeCli().install(runtime, ctx)
