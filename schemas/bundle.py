"""A portable replay bundle (``polar bundle``): what a replay or a re-grade of recorded
sessions needs, in one file another stack reads with no access to this one.

The file is a gzipped tar:

    manifest.json                  BundleManifest
    sessions/<session_id>/records.jsonl   its CompletionRecords, one JSON each, in order
    sessions/<session_id>/trajectory.json the scored Trajectory, when stored
    sessions/<session_id>/artifacts.json  the run's Artifacts, when stored
    objects/<object store name>    prompt images and MoE routing rows the records name
    files/<n>/...                  what the task's prepare steps upload from the node
"""

from __future__ import annotations

from msgspec import Struct

from schemas.session import Session
from schemas.task import TaskRequest

BUNDLE_FORMAT = "polar-bundle"
MANIFEST = "manifest.json"


def records_member(session_id: str) -> str:
    return f"sessions/{session_id}/records.jsonl"


def trajectory_member(session_id: str) -> str:
    return f"sessions/{session_id}/trajectory.json"


def artifacts_member(session_id: str) -> str:
    return f"sessions/{session_id}/artifacts.json"


def object_member(name: str) -> str:
    return f"objects/{name}"


class BundledSession(Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One recorded session: its registry record (the token blanked) and its task, whose
    prepare steps name ``files/<n>`` where they named a path of the node (``sources``
    keeps what each was)."""

    session: Session
    task: TaskRequest
    records: int  # CompletionRecords in records.jsonl
    objects: list[str] = []  # object-store names under objects/
    trajectory: bool = False  # trajectory.json is there
    artifacts: bool = False  # artifacts.json is there
    harness: str | None = None
    harness_version: str | None = None
    sources: dict[str, str] = {}  # files/<n> -> the node path the task named


class BundleManifest(Struct, frozen=True, kw_only=True, omit_defaults=True):
    v: int = 1
    format: str = BUNDLE_FORMAT
    created_at: float
    # the stack that recorded them: polar, python, nats-server, the harnesses' versions
    versions: dict[str, str] = {}
    redacted: bool = False  # text fields and the tasks' env values redacted (--redact)
    sessions: list[BundledSession]
