"""File I/O on the node for runtimes whose files live in a session directory."""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

from services.runtimes.errors import SandboxIOError


def confined(root: Path, path: str | Path) -> Path:
    """`path` resolved on the node, refusing anything (symlinks included) outside `root`.

    Plain strings, not pathlib (several calls per session, each a few syscalls per path
    part); `root` is resolved once per process: it is a directory this node made, under
    the node's work dir, which no sandbox can replace (a sandbox sees it as its own root
    at most), while `path` may cross links a sandbox planted and is resolved every time."""
    resolved = os.path.realpath(path)
    top = _real_root(str(root))
    if resolved != top and not resolved.startswith(top.rstrip("/") + "/"):
        raise SandboxIOError(f"path {str(path)!r} is outside the session directory")
    return Path(resolved)


@functools.lru_cache(maxsize=256)
def _real_root(root: str) -> str:
    return os.path.realpath(root)


def read_node_file(src: Path | None) -> bytes:
    if src is None:
        raise SandboxIOError("upload_file needs data or src")
    try:
        return Path(src).read_bytes()
    except OSError as exc:
        raise SandboxIOError(f"cannot read {src}: {exc.strerror}") from exc


def read_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise SandboxIOError(f"cannot read {path}: {exc.strerror}") from exc


def write_file(target: Path, data: bytes, mode: int) -> None:
    """Create `target` afresh (never writing through a link someone left there)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            target.unlink()
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(target, mode)  # the umask must not narrow the requested mode
    except OSError as exc:
        raise SandboxIOError(f"cannot write {target}: {exc.strerror}") from exc
