"""Tar archives in memory: how files travel into and out of containers."""

from __future__ import annotations

import io
import os
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
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, filter="data")
            else:  # Python 3.11.0-3.11.3 (Debian 12's 3.11.2) has no extraction filters
                _extract_checked(tar, dest)
    except (tarfile.TarError, OSError) as exc:
        raise SandboxIOError(f"cannot unpack into {dest}: {exc}") from exc


def _extract_checked(tar: tarfile.TarFile, dest: Path) -> None:
    """What the "data" filter does, member by member as each is written (a symlink an
    earlier member planted is on disk when a later one is checked): leading slashes
    stripped; names and link targets that resolve outside ``dest``, absolute link
    targets and special files refused; set-id bits and group/other write cleared."""
    root = os.path.realpath(dest)

    def inside(path: str) -> bool:
        return os.path.commonpath([root, os.path.realpath(path)]) == root

    for member in tar.getmembers():
        member.name = member.name.lstrip("/" + os.sep)  # as the filter does: made relative
        target = os.path.join(root, member.name)
        if not inside(target):
            raise tarfile.TarError(f"{member.name!r} would be written outside {dest}")
        if member.issym() or member.islnk():
            if os.path.isabs(member.linkname):
                raise tarfile.TarError(f"{member.name!r} links to an absolute path")
            base = os.path.dirname(target) if member.issym() else root
            if not inside(os.path.join(base, member.linkname)):
                raise tarfile.TarError(f"{member.name!r} links outside {dest}")
        elif not (member.isfile() or member.isdir()):
            raise tarfile.TarError(f"{member.name!r} is a special file")
        member.mode &= 0o755  # no set-id or sticky bits, no write for group or others
        if member.isfile():
            member.mode |= 0o600
        tar.extract(member, root, set_attrs=not (member.issym() or member.islnk()))
