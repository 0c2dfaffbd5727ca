"""Bundles and the bus: what ``polar bundle`` reads from a stack, and what
``polar replay --bundle`` puts into another one before it replays."""

from __future__ import annotations

import importlib.metadata
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

from nats.js.errors import ObjectNotFoundError

from schemas import (
    Artifacts,
    CompletionRecord,
    ContractError,
    Session,
    TaskRequest,
    Trajectory,
    decode,
    encode,
)
from schemas import subjects as S
from schemas.bundle import (
    BundledSession,
    BundleManifest,
    artifacts_member,
    object_member,
    records_member,
    trajectory_member,
)
from services.bundle import pack
from services.bundle.pack import BundleError
from services.common.bus import Bus
from services.common.completions import last_seq, read_completions
from services.common.registry import Registry
from services.export.reader import read_stored


@dataclass
class Collected:
    manifest: BundleManifest
    members: dict[str, bytes] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)  # bundle name -> node path


async def sessions_of(registry: Registry, targets: list[str]) -> list[Session]:
    """The sessions named, and every session of the tasks named, in order."""
    found: list[Session] = []
    for target in targets:
        session = await registry.get_session(target)
        sessions = [session] if session else await registry.task_sessions(target)
        if not sessions:
            raise BundleError(f"no session or task {target} in the registry")
        found += sorted(sessions, key=lambda s: s.index)
    return found


def object_names(records: list[CompletionRecord]) -> list[str]:
    """The object-store blobs the records name: prompt images, MoE routing rows."""
    names = {S.image_object(i.digest) for r in records for i in r.images}
    names |= {r.routing.object for r in records if r.routing is not None}
    return sorted(names)


async def _object(bus: Bus, name: str) -> bytes | None:
    try:
        return (await (await bus.blobs()).get(name)).data
    except ObjectNotFoundError:
        return None


async def _trajectories(bus: Bus, task_id: str) -> dict[tuple[str, int], Trajectory]:
    subject = S.trajectories(task_id)
    stored = read_stored(bus, S.STREAM_TRAJECTORIES, subject)
    return {(t.session_id, t.attempt): t async for t, _ in stored}


async def collect(bus: Bus, registry: Registry, targets: list[str], redact: bool) -> Collected:
    """Everything a replay or re-grade of ``targets`` needs, read from this stack."""
    sessions = await sessions_of(registry, targets)
    out = Collected(BundleManifest(created_at=time.time(), sessions=[]))
    bundled: list[BundledSession] = []
    specs: dict[str, TaskRequest] = {}
    stored: dict[str, dict[tuple[str, int], Trajectory]] = {}
    for session in sessions:
        if session.task_id not in specs:
            spec = await registry.task_spec(session.task_id)
            if spec is None:
                raise BundleError(f"task {session.task_id} is no longer in the registry")
            specs[session.task_id] = spec
            stored[session.task_id] = await _trajectories(bus, session.task_id)
        task = specs[session.task_id]
        bundled.append(await _one(bus, out, session, task, stored[session.task_id], redact))
    versions = await _versions(bus, bundled)
    out.manifest = BundleManifest(
        created_at=out.manifest.created_at, versions=versions, redacted=redact, sessions=bundled
    )
    return out


async def _one(bus, out: Collected, session, task, stored, redact: bool) -> BundledSession:
    sid = session.session_id
    records, problems = await read_completions(bus, sid)
    if problems:
        raise BundleError(f"{sid}: its records cannot all be read: {problems[0]}")
    if not records:
        raise BundleError(f"{sid}: no records in POLAR_COMPLETIONS (expired, or no calls)")
    clean = (lambda v: pack.redacted(v, task)) if redact else (lambda v: v)
    out.members[records_member(sid)] = b"\n".join(encode(clean(r)) for r in records)
    objects = []
    for name in object_names(records):
        if (data := await _object(bus, name)) is not None:
            out.members[object_member(name)] = data
            objects.append(name)
    trajectory = stored.get((sid, session.attempt))
    if trajectory is not None:
        out.members[trajectory_member(sid)] = encode(clean(trajectory))
    raw = await _object(bus, S.artifacts_object(sid, session.attempt))
    if raw is not None:
        out.members[artifacts_member(sid)] = encode(clean(decode(raw, Artifacts)))
    portable, sources = pack.portable_task(pack.redacted_task(task) if redact else task)
    for member, src in sources.items():
        out.files[member] = Path(src)
    return BundledSession(
        session=pack.blank_token(session),
        task=portable,
        records=len(records),
        objects=objects,
        trajectory=trajectory is not None,
        artifacts=raw is not None,
        harness=trajectory.harness if trajectory else task.agent.harness,
        harness_version=trajectory.harness_version if trajectory else None,
        sources=sources,
    )


async def _versions(bus: Bus, sessions: list[BundledSession]) -> dict[str, str]:
    versions = {
        "polar": importlib.metadata.version("polar-rollout"),
        "python": platform.python_version(),
        "nats-server": str(bus.nc.connected_server_version),
    }
    for s in sessions:
        if s.harness and s.harness_version:
            versions[f"harness:{s.harness}"] = s.harness_version
    return versions


# -- into another stack ---------------------------------------------------------------
async def install(
    bus: Bus, manifest: BundleManifest, root: Path
) -> list[tuple[Session, TaskRequest]]:
    """Each bundled session's records and blobs put into this stack (once: a session
    whose records are here already is left as it is), and (its session, its task with
    the bundle's files unpacked under ``root``) to replay it."""
    out = []
    for b in manifest.sessions:
        sid = b.session.session_id
        if await last_seq(bus, S.completions(sid)) is None:
            for r in bundled_records(root / records_member(sid), sid, b.records):
                await bus.send(
                    S.completions(sid), encode(r), msg_id=S.completion_msg_id(sid, r.seq)
                )
        store = await bus.blobs()
        for name in b.objects:
            try:
                await store.get_info(name)
            except ObjectNotFoundError:
                await store.put(name, _read(root / object_member(name)))
        out.append((b.session, pack.local_task(b.task, root)))
    return out


def bundled_records(path: Path, session_id: str, expected: int) -> list[CompletionRecord]:
    """A session's records as the bundle holds them (all of them, or an error)."""
    try:
        lines = path.read_bytes().split(b"\n")
    except FileNotFoundError:
        raise BundleError(f"the bundle has no records for {session_id}") from None
    try:
        records = [decode(line, CompletionRecord) for line in lines if line]
    except ContractError as exc:
        raise BundleError(f"{session_id}: a record is not this version's: {exc}") from None
    if len(records) != expected:
        raise BundleError(f"{session_id}: {len(records)} records, the manifest says {expected}")
    return records


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise BundleError(f"the bundle lacks {path.name}, which its manifest names") from None
