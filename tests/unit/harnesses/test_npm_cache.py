"""The node's CLI install cache, with real npm on a local tarball (no network)."""

from __future__ import annotations

import asyncio

import pytest

from services.node.harnesses import npm
from services.node.harnesses.npm import NpmPackage, ensure_installed
from tests.helpers.requires import requires_npm
from tests.unit.harnesses.support import fake_cli_tarball

pytestmark = requires_npm


@pytest.fixture(scope="module")
def tarball(tmp_path_factory):
    return fake_cli_tarball(tmp_path_factory.mktemp("pkg"))


def fake(tarball, version: str = "1.0.0") -> NpmPackage:
    return NpmPackage("polar-fake-cli", version, "fakecli", source=str(tarball))


def test_names_and_versions():
    pkg = NpmPackage("@openai/codex", "0.171.0", "codex")
    assert pkg.slug == "openai+codex-0.171.0" and pkg.spec == "@openai/codex@0.171.0"
    assert pkg.bin_path("/c") == "/c/openai+codex-0.171.0/node_modules/.bin/codex"
    assert npm.is_exact("1.6.0") and npm.is_exact("2.0.0-beta.3")
    assert not npm.is_exact("latest") and not npm.is_exact("^1.2.0")
    assert npm.node_version("v22.23.3\n") == (22, 23) and npm.node_version("") == (0, 0)


async def test_concurrent_sessions_share_one_install(tmp_path, tarball):
    cache = tmp_path / "cache"
    got = await asyncio.gather(*(ensure_installed(cache, fake(tarball)) for _ in range(3)))
    assert [g.cached for g in got].count(False) == 1  # one npm run, the others waited
    assert len({g.path for g in got}) == 1
    proc = await asyncio.create_subprocess_exec(got[0].path, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    assert b'"argv":[]' in out  # the installed executable runs
    again = await ensure_installed(cache, fake(tarball))
    assert again.cached and again.seconds < 0.5
    leftovers = [p.name for p in cache.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers == []


async def test_an_unfinished_install_is_redone_not_trusted(tmp_path, tarball):
    cache = tmp_path / "cache"
    half = cache / fake(tarball).slug / "node_modules"
    half.mkdir(parents=True)  # what a process killed mid-install leaves: no marker
    got = await ensure_installed(cache, fake(tarball))
    assert not got.cached and (cache / fake(tarball).slug / npm.MARKER).is_file()


async def test_a_failed_install_says_why_and_leaves_nothing(tmp_path):
    cache = tmp_path / "cache"
    missing = NpmPackage("polar-fake-cli", "1.0.0", "fakecli", source=str(tmp_path / "no.tgz"))
    with pytest.raises(npm.InstallError, match="npm install --prefix failed"):
        await ensure_installed(cache, missing, timeout=120)
    assert not npm.installed(cache, missing)
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".locks")] == []


async def test_a_package_without_the_named_executable_is_refused(tmp_path, tarball):
    wrong = NpmPackage("polar-fake-cli", "1.0.0", "othercli", source=str(tarball))
    with pytest.raises(npm.InstallError, match="installed no `othercli`"):
        await ensure_installed(tmp_path / "cache", wrong)


async def test_file_lock_excludes_and_times_out(tmp_path):
    lock = tmp_path / "x.lock"
    async with npm.file_lock(lock, timeout=5):
        with pytest.raises(npm.InstallError, match="waited"):
            async with npm.file_lock(lock, timeout=0.3):
                pass
    async with npm.file_lock(lock, timeout=0.3):  # released
        pass


def test_versions_sort_as_semver():
    listed = ["0.73.1", "0.73.0", "0.10.2", "0.9.12", "1.0.0-beta.2", "1.0.0-beta.10", "1.0.0"]
    assert max(listed, key=npm.version_key) == "1.0.0"
    assert sorted(listed, key=npm.version_key) == [
        "0.9.12",
        "0.10.2",
        "0.73.0",
        "0.73.1",
        "1.0.0-beta.2",
        "1.0.0-beta.10",
        "1.0.0",
    ]
