"""In-memory tar helpers: how files travel into and out of containers."""

from __future__ import annotations

import io
import tarfile

import pytest

from services.runtimes import tarutil
from services.runtimes.errors import SandboxIOError


def test_file_tar_round_trip_keeps_mode():
    archive = tarutil.file_tar("f.txt", b"data", 0o755)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        (member,) = tar.getmembers()
    assert member.name == "f.txt" and member.mode == 0o755 and member.size == 4
    assert tarutil.single_file(archive) == b"data"


def test_dir_tar_extract_round_trip(tmp_path):
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "x").write_text("x")
    (src / "y").write_text("y")
    tarutil.extract_tar(tarutil.dir_tar(src), tmp_path / "out")
    assert (tmp_path / "out/d/x").read_text() == "x"
    assert (tmp_path / "out/y").read_text() == "y"


def test_strip_top_dir_re_roots_a_get_archive_tar(tmp_path):
    src = tmp_path / "top"
    (src / "d").mkdir(parents=True)
    (src / "d" / "x").write_text("x")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(src, arcname="top")
    stripped = tarutil.strip_top_dir(buf.getvalue())
    with tarfile.open(fileobj=io.BytesIO(stripped)) as tar:
        assert sorted(tar.getnames()) == ["d", "d/x"]


def test_extract_refuses_members_escaping_the_destination(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(SandboxIOError):
        tarutil.extract_tar(buf.getvalue(), tmp_path / "dest")
    assert not (tmp_path / "escaped.txt").exists()


def test_extract_refuses_writing_through_a_planted_symlink(tmp_path):
    dest = tmp_path / "dest"
    dest.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (dest / "link").symlink_to(outside)
    src = tmp_path / "src"
    (src / "link").mkdir(parents=True)
    (src / "link" / "f").write_text("x")
    with pytest.raises(SandboxIOError):
        tarutil.extract_tar(tarutil.dir_tar(src), dest)
    assert not (outside / "f").exists()


def test_single_file_rejects_a_directory_archive(tmp_path):
    (tmp_path / "a").write_text("a")
    (tmp_path / "b").write_text("b")
    with pytest.raises(SandboxIOError, match="found 2"):
        tarutil.single_file(tarutil.dir_tar(tmp_path))
