"""Markers for tests that need a part outside the venv: each skips, when the part is
missing, with a reason that names it and how to get it (`just test` lists them at the end).

`just setup` (infra/setup.py) installs these parts where this user can; see its docstring.
The checks run once the tests are collected (tests/conftest.py), and only for parts a
collected test names, so a session that selects none never pings a Docker engine.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

import pytest

from infra import setup

SETUP = "`just setup` installs it as root with apt"


def _docker_host() -> str | None:
    """DOCKER_HOST, else the socket `just setup` starts podman's Docker API on."""
    host = os.environ.get("DOCKER_HOST") or setup.read_env().get("DOCKER_HOST")
    if host is None and setup.PODMAN_SOCKET.exists():
        host = f"unix://{setup.PODMAN_SOCKET}"
    return host


DOCKER_HOST = _docker_host()
IMAGE = setup.TEST_IMAGE


@functools.cache
def docker_missing() -> str | None:
    """Why the docker runtime's tests cannot run here, or None."""
    if DOCKER_HOST is None:
        return (
            f"no Docker engine: DOCKER_HOST unset and no podman socket at {setup.PODMAN_SOCKET} "
            f"(needs podman + runc: {SETUP}, then starts podman's Docker API)"
        )
    answers, image = setup.engine_state(DOCKER_HOST)
    if not answers:
        return f"no Docker engine answers at {DOCKER_HOST}: `just setup` starts podman's Docker API"
    if not image:
        return f"image {IMAGE} missing at {DOCKER_HOST}: `just setup` builds it offline"
    return None


def bwrap_missing() -> str | None:
    if shutil.which("bwrap") is None:
        return f"bubblewrap (bwrap) is not on PATH: {SETUP}, or `sudo apt-get install bubblewrap`"
    return None


def npm_missing() -> str | None:
    if shutil.which("npm") is None:
        return (
            "npm is not on PATH: install Node.js with npm (Debian: `apt-get install npm`); "
            "`just setup` then preinstalls the agent CLIs"
        )
    return None


def netns_missing() -> str | None:
    """Why the multi-host test (hosts as network namespaces) cannot run here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add`): run as root, as CI does"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not on PATH: `apt-get install iproute2`"
    return _netns_refused()


@functools.cache
def _netns_refused() -> str | None:
    """Root is not always enough (a container without CAP_SYS_ADMIN / CAP_NET_ADMIN, or
    a read-only /run): make a namespace with a veth pair in it, as the test does."""
    name = f"polarprobe{os.getpid()}"
    steps = [
        ["ip", "netns", "add", name],
        ["ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1"],
    ]
    try:
        for argv in steps:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
            if done.returncode != 0:
                return (
                    f"network namespaces cannot be made here (`{' '.join(argv)}`: "
                    f"{done.stderr.strip()[:200]}): they need root with CAP_SYS_ADMIN and "
                    "CAP_NET_ADMIN, as CI has"
                )
        return None
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


def vllm_missing() -> str | None:
    from infra.vllm import installed_problem

    return installed_problem()


def vllm_routing_missing() -> str | None:
    from infra.vllm import routed_experts_problem

    return routed_experts_problem()


MISSING = {
    "bwrap": bwrap_missing,
    "docker": docker_missing,
    "npm": npm_missing,
    "netns": netns_missing,
    "vllm": vllm_missing,
    "vllm_routing": vllm_routing_missing,
}

requires_bwrap = pytest.mark.requires("bwrap")
requires_docker = pytest.mark.requires("docker")
requires_npm = pytest.mark.requires("npm")
requires_netns = pytest.mark.requires("netns")
requires_vllm = pytest.mark.requires("vllm")
requires_vllm_routing = pytest.mark.requires("vllm", "vllm_routing")


def missing_reason(item: pytest.Item) -> str | None:
    """Why ``item`` cannot run here: the first part its ``requires`` marks name that is
    missing, or None."""
    for mark in item.iter_markers("requires"):
        for part in mark.args:
            if part not in MISSING:
                raise pytest.UsageError(f"requires({part!r}): use one of {', '.join(MISSING)}")
            if reason := MISSING[part]():
                return reason
    return None
