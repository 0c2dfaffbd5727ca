"""Bundles without servers: tasks made portable and back, redaction, the file."""

import gzip
import io
import tarfile

import msgspec
import pytest

from schemas import ImageSpan, Session, TaskRequest, decode, encode
from schemas.bundle import BundledSession, BundleManifest
from schemas.routing import RoutedExperts
from services.bundle.collect import bundled_records, object_names
from services.bundle.pack import (
    BundleError,
    blank_token,
    local_task,
    portable_task,
    read_bundle,
    redacted_task,
    unpack,
    write_bundle,
)
from tests.unit.proxy.test_replay import RECORDS

TASK = msgspec.convert(
    {
        "task_id": "calc",
        "instruction": "fix calc.py",
        "runtime": {
            "backend": "local",
            "env": {"OPENAI_API_KEY": "sk-live-abcdefghijklmnop"},
            "prepare": [
                {"action": "upload_dir", "src": "/srv/calc", "dest": "."},
                {"action": "upload_file", "content": "hi", "dest": "note.txt"},
                {"action": "upload_file", "src": "/srv/agent.py", "dest": "agent.py"},
            ],
        },
        "agent": {"harness": "shell", "command": "python3 agent.py"},
    },
    TaskRequest,
)
SESSION = Session(session_id="calc-0000", task_id="calc", index=0, token="ps_secret123456789")


def test_a_portable_task_names_the_bundles_files_and_comes_back_local(tmp_path):
    portable, sources = portable_task(TASK)
    assert sources == {"files/0": "/srv/calc", "files/1": "/srv/agent.py"}
    assert [getattr(s, "src", None) for s in portable.runtime.prepare] == [
        "files/0",
        None,
        "files/1",
    ]
    back = local_task(portable, tmp_path)
    assert [getattr(s, "src", None) for s in back.runtime.prepare] == [
        str(tmp_path / "files/0"),
        None,
        str(tmp_path / "files/1"),
    ]


def test_the_token_is_never_bundled_and_redaction_hides_env_values():
    assert blank_token(SESSION).token == "[redacted]"
    task = redacted_task(TASK)
    assert "sk-live-abcdefghijklmnop" not in encode(task).decode()
    assert task.instruction == "fix calc.py"


def test_a_bundle_file_round_trips_with_its_files(tmp_path):
    src = tmp_path / "calc"
    src.mkdir()
    (src / "calc.py").write_text("def add(a, b): return a - b\n")
    manifest = BundleManifest(
        created_at=1.0,
        versions={"polar": "0.1.0"},
        sessions=[
            BundledSession(session=blank_token(SESSION), task=portable_task(TASK)[0], records=2)
        ],
    )
    path = tmp_path / "out" / "b.polar"
    size = write_bundle(
        path, manifest, {"sessions/calc-0000/records.jsonl": b"{}"}, {"files/0": src}
    )
    assert size == path.stat().st_size > 0
    root, read = unpack(path, tmp_path / "unpacked")
    assert read == manifest
    assert (root / "files/0/calc.py").read_text().startswith("def add")
    assert unpack(path, tmp_path / "unpacked")[0] == root  # the same file, the same place


def test_what_is_not_a_bundle_is_refused_saying_why(tmp_path):
    junk = tmp_path / "junk"
    junk.write_bytes(b"hello")
    with pytest.raises(BundleError, match="not a polar bundle"):
        read_bundle(junk, tmp_path / "a")
    with pytest.raises(BundleError, match="cannot read"):
        unpack(tmp_path / "missing", tmp_path / "b")
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:  # a tar, but no manifest
        info = tarfile.TarInfo("other.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    notes = tmp_path / "notes.tgz"
    notes.write_bytes(gzip.compress(raw.getvalue()))
    with pytest.raises(BundleError, match="no manifest.json"):
        read_bundle(notes, tmp_path / "c")
    with pytest.raises(BundleError, match="not on this machine"):
        write_bundle(
            tmp_path / "d.polar",
            BundleManifest(created_at=0, sessions=[]),
            {},
            {"files/0": tmp_path / "gone"},
        )


def test_records_come_back_as_bundled_or_not_at_all(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_bytes(b"\n".join(encode(r) for r in RECORDS.values()))
    assert [r.seq for r in bundled_records(path, "orig-0000", 2)] == [0, 1]
    assert decode(encode(RECORDS[0]), type(RECORDS[0])) == RECORDS[0]
    with pytest.raises(BundleError, match="2 records, the manifest says 3"):
        bundled_records(path, "orig-0000", 3)
    path.write_bytes(b'{"seq": "x"}')
    with pytest.raises(BundleError, match="not this version's"):
        bundled_records(path, "orig-0000", 1)
    with pytest.raises(BundleError, match="no records for"):
        bundled_records(tmp_path / "none", "orig-0000", 1)


def test_the_blobs_a_session_needs_are_its_images_and_routing():
    assert object_names(list(RECORDS.values())) == []
    image = ImageSpan(digest="sha256:ab", start=0, length=4)
    routing = RoutedExperts(
        object="routing/s/0/1", start=0, rows=3, layers=2, top_k=2, dtype="uint8"
    )
    with_blobs = [
        msgspec.structs.replace(RECORDS[0], images=[image]),
        msgspec.structs.replace(RECORDS[1], images=[image], routing=routing),
    ]
    assert object_names(with_blobs) == ["images/sha256-ab", "routing/s/0/1"]
