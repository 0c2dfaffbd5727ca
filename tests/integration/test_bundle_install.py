"""``polar replay --bundle`` puts a bundle's records and blobs into a stack once: a second
install of the same bundle reuses them (real NATS JetStream and object store)."""

from __future__ import annotations

import uuid

from schemas import Session, TaskRequest, encode
from schemas.bundle import BundledSession, BundleManifest, object_member, records_member
from services.bundle.collect import install
from services.common.completions import read_completions
from tests.unit.proxy.test_replay import RECORDS

TASK = TaskRequest(instruction="fix calc.py")


def bundle_dir(root, sid: str, blob: str) -> BundleManifest:
    (root / records_member(sid)).parent.mkdir(parents=True)
    (root / records_member(sid)).write_bytes(b"\n".join(encode(r) for r in RECORDS.values()))
    (root / object_member(blob)).parent.mkdir(parents=True)
    (root / object_member(blob)).write_bytes(b"png bytes")
    session = Session(session_id=sid, task_id="orig", index=0, token="[redacted]")
    bundled = BundledSession(session=session, task=TASK, records=2, objects=[blob])
    return BundleManifest(created_at=0.0, sessions=[bundled])


async def test_a_bundle_is_installed_once_and_its_blobs_with_it(bus, tmp_path):
    sid = f"bundled-{uuid.uuid4().hex[:8]}-0000"  # the servers may be shared: its own
    blob = f"images/sha256-{uuid.uuid4().hex}"
    manifest = bundle_dir(tmp_path, sid, blob)
    [(session, task)] = await install(bus, manifest, tmp_path)
    assert session.session_id == sid and task.instruction == "fix calc.py"
    await install(bus, manifest, tmp_path)  # again: nothing put twice
    records, problems = await read_completions(bus, sid)
    assert [r.seq for r in records] == [0, 1] and not problems
    assert [r.output_ids for r in records] == [RECORDS[0].output_ids, RECORDS[1].output_ids]
    assert (await (await bus.blobs()).get(blob)).data == b"png bytes"
