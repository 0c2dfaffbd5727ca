"""Bundles without servers: a task made portable (its node paths into the bundle) and
back, redaction, and the file itself (``schemas.bundle`` says what is in it)."""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
import time
from pathlib import Path

import msgspec

from schemas import ContractError, Session, TaskRequest, decode, encode
from schemas.bundle import MANIFEST, BundleManifest
from services.common.redact import known_secrets, redact_struct, scrub_known_struct
from services.runtimes.errors import SandboxIOError
from services.runtimes.tarutil import extract_tar

REDACTED = "[redacted]"


class BundleError(ValueError):
    """Not a bundle this version reads, or one whose parts are missing: said with why."""


def _with_prepare(task: TaskRequest, prepare: list) -> TaskRequest:
    runtime = msgspec.structs.replace(task.runtime, prepare=prepare)
    return msgspec.structs.replace(task, runtime=runtime)


def portable_task(task: TaskRequest) -> tuple[TaskRequest, dict[str, str]]:
    """``task`` with each prepare step's node path (``src``) named ``files/<n>`` instead,
    and {files/<n>: the path it was}: the bundle carries those files."""
    sources: dict[str, str] = {}
    prepare = []
    for step in task.runtime.prepare:
        src = getattr(step, "src", None)
        if src is not None:
            member = f"files/{len(sources)}"
            sources[member] = src
            step = msgspec.structs.replace(step, src=member)
        prepare.append(step)
    return _with_prepare(task, prepare), sources


def local_task(task: TaskRequest, root: Path) -> TaskRequest:
    """A bundled task whose ``files/<n>`` are the files unpacked under ``root``."""
    prepare = []
    for step in task.runtime.prepare:
        src = getattr(step, "src", None)
        if src is not None and src.startswith("files/"):
            step = msgspec.structs.replace(step, src=str(root / src))
        prepare.append(step)
    return _with_prepare(task, prepare)


def blank_token(session: Session) -> Session:
    """A session's token is a live credential on its stack: never bundled."""
    return msgspec.structs.replace(session, token=REDACTED)


def redacted_task(task: TaskRequest) -> TaskRequest:
    """Every env value the task gives (they hold API keys) replaced, then the rest by shape."""
    known = known_secrets(None, task)
    return redact_struct(scrub_known_struct(task, known))


def redacted(value, task: TaskRequest):
    """A record, trajectory or artifacts with what ``redacted_task`` hides hidden too.
    Token ids stay as sampled (as in every trajectory): only text is redacted."""
    return redact_struct(scrub_known_struct(value, known_secrets(None, task)))


def write_bundle(
    path: Path, manifest: BundleManifest, members: dict[str, bytes], files: dict[str, Path]
) -> int:
    """The bundle file; its size. ``members``: bytes by name; ``files``: node files or
    directories by the name they get inside."""
    path.parent.mkdir(parents=True, exist_ok=True)
    now = time.time()
    with tarfile.open(path, "w:gz") as tar:
        for name, data in {MANIFEST: encode(manifest), **members}.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), now, 0o644
            tar.addfile(info, io.BytesIO(data))
        for name, src in files.items():
            if not src.exists():
                raise BundleError(f"{src} (a prepare step's src) is not on this machine")
            tar.add(src, arcname=name)
    return path.stat().st_size


def unpack(path: Path, under: Path) -> tuple[Path, BundleManifest]:
    """The bundle unpacked into ``under/<its digest>`` (the same file, the same place),
    and its manifest."""
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError as exc:
        raise BundleError(f"cannot read {path}: {exc.strerror}") from None
    root = under / digest
    return root, read_bundle(path, root)


def read_bundle(path: Path, into: Path) -> BundleManifest:
    """Unpack ``path`` under ``into`` (members checked: nothing lands outside it); its
    manifest."""
    try:
        raw = gzip.decompress(path.read_bytes())
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise BundleError(f"{path} is not a polar bundle (a gzipped tar): {exc}") from None
    into.mkdir(parents=True, exist_ok=True)
    try:
        extract_tar(raw, into)
    except SandboxIOError as exc:
        raise BundleError(f"{path}: cannot unpack it: {exc}") from None
    return manifest_of(into)


def manifest_of(root: Path) -> BundleManifest:
    try:
        manifest = decode((root / MANIFEST).read_bytes(), BundleManifest)
    except FileNotFoundError:
        raise BundleError(f"no {MANIFEST}: not a polar bundle") from None
    except ContractError as exc:
        raise BundleError(f"{MANIFEST} is not this version's: {exc}") from None
    if manifest.v != 1:
        raise BundleError(f"bundle format v{manifest.v}: this polar reads v1")
    return manifest
