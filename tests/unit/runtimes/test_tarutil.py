"""In-memory tar helpers: how files travel into and out of containers."""

from __future__ import annotations

import io
import tarfile

import pytest

from services.runtimes import tarutil
from services.runtimes.errors import SandboxIOError


@pytest.fixture(params=["filter", "checked"])
def unpacking(request, monkeypatch):
    """Both ways ``extract_tar`` unpacks: tarfile's "data" filter, and its own checks
    where the filter does not exist (Python 3.11.0-3.11.3: Debian 12's python3)."""
    if request.param == "checked":
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    return request.param


def test_file_tar_round_trip_keeps_mode():
    archive = tarutil.file_tar("f.txt", b"data", 0o755)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        (member,) = tar.getmembers()
    assert member.name == "f.txt" and member.mode == 0o755 and member.size == 4
    assert tarutil.single_file(archive) == b"data"


def test_dir_tar_extract_round_trip(tmp_path, unpacking):
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


def test_extract_refuses_members_escaping_the_destination(tmp_path, unpacking):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(SandboxIOError):
        tarutil.extract_tar(buf.getvalue(), tmp_path / "dest")
    assert not (tmp_path / "escaped.txt").exists()


def test_extract_refuses_writing_through_a_planted_symlink(tmp_path, unpacking):
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


def _archive(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


@pytest.mark.parametrize(
    "member",
    [
        _link("out", "../../etc"),  # a link whose target leaves the destination
        _link("abs", "/etc/passwd"),
        _link("hard", "../x", tarfile.LNKTYPE),
    ],
    ids=["symlink-out", "symlink-absolute", "hardlink-out"],
)
def test_extract_refuses_links_and_names_outside(tmp_path, unpacking, member):
    with pytest.raises(SandboxIOError):
        tarutil.extract_tar(_archive((member, None)), tmp_path / "dest")


def test_extract_strips_set_id_bits_and_keeps_links_inside(tmp_path, unpacking):
    script = tarfile.TarInfo("bin/run")
    script.size, script.mode = 2, 0o4777
    absolute = tarfile.TarInfo("/abs.txt")  # made relative: written inside
    absolute.size = 1
    archive = _archive((script, b"hi"), (_link("run", "bin/run"), None), (absolute, b"a"))
    tarutil.extract_tar(archive, tmp_path / "dest")
    assert (tmp_path / "dest/abs.txt").read_text() == "a"
    assert (tmp_path / "dest/run").read_text() == "hi"
    assert (tmp_path / "dest/bin/run").stat().st_mode & 0o7777 == 0o755
