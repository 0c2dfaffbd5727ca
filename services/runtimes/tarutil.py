"""Tar archives in memory: how files travel into and out of containers."""

from __future__ import annotations

import io
import tarfile
import time
from pathlib import Path

from services.runtimes.errors import SandboxIOError


def file_tar(name: str, data: bytes, mode: int = 0o644) -> bytes:
    """A tar holding one file (no directory entries: existing directories keep their modes)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(data), mode, time.time()
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def dir_tar(src: Path) -> bytes:
    """A tar of what is in directory `src`, member names relative to it."""
    if not src.is_dir():
        raise SandboxIOError(f"not a directory: {src}")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for child in sorted(src.iterdir()):
            tar.add(child, arcname=child.name)
    return buf.getvalue()


def single_file(tar_bytes: bytes) -> bytes:
    """The content of the one regular file in a tar (what get_archive returns for a file)."""
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        if len(members) != 1:
            raise SandboxIOError(f"expected one file in the archive, found {len(members)}")
        extracted = tar.extractfile(members[0])
        assert extracted is not None  # a regular file always has content
        return extracted.read()


def strip_top_dir(tar_bytes: bytes) -> bytes:
    """Re-root a tar whose members all sit under one top directory (get_archive of a dir)."""
    out = io.BytesIO()
    with (
        tarfile.open(fileobj=io.BytesIO(tar_bytes)) as src,
        tarfile.open(fileobj=out, mode="w") as dst,
    ):
        for member in src.getmembers():
            _, _, rest = member.name.partition("/")
            if not rest:
                continue  # the top directory itself
            member.name = rest
            content = src.extractfile(member) if member.isfile() else None
            dst.addfile(member, content)
    return out.getvalue()


def extract_tar(tar_bytes: bytes, dest: Path) -> None:
    """Unpack a tar into `dest` on the node, refusing members that escape it."""
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise SandboxIOError(f"cannot unpack into {dest}: {exc}") from exc
