"""The docs site's diagrams: mermaid's browser build, served by the site itself.

mermaid's ``dist/mermaid.min.js`` is 3.5 MB (1 MB gzipped): too big to keep in git, so
the build fetches the pinned release once from the npm registry (``npm pack``, no install
scripts), checks the file against its pinned digest and keeps it, git-ignored, in
``build/docs-vendor/``; the hooks (``infra/docgen/mkdocs_hooks.py``) copy it into the site
and load it on the pages that draw a diagram. No page loads anything from elsewhere.

Without npm, place the file there by hand (``npm pack mermaid@VERSION`` on any machine,
then ``package/dist/mermaid.min.js`` from the tarball): its digest is checked all the same.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "build" / "docs-vendor"
# Material for MkDocs drives mermaid 11's API (it would load mermaid@11 from a CDN if no
# copy were on the page): the newest 11.x, its npm integrity and the file's sha256.
MERMAID_VERSION = "11.17.2"
MERMAID_INTEGRITY = "sha512-V6K3C8EBdEsPFZXSKMJe6ppQOENxuHARr9GvHX4hh47lAbhMRD9qf4oEK7LoaRQxULMa80/qt5gHO73aCleBBg=="
MERMAID_SHA256 = "581ed7d74bd9048d0e3a91363927d72ef22942d7722546b27f7cc29e35390eb8"
MERMAID_MEMBER = "package/dist/mermaid.min.js"
SITE_PATH = "assets/vendor/mermaid.min.js"  # where the site serves it


class VendorError(RuntimeError):
    """The pinned file is not here and cannot be fetched (the message says how to get it)."""


def mermaid_path(cache: Path = CACHE) -> Path:
    return cache / f"mermaid-{MERMAID_VERSION}.min.js"


def ensure_mermaid(cache: Path = CACHE, npm: str | None = None) -> Path:
    """The checked local copy of mermaid's browser build, fetched when missing."""
    path = mermaid_path(cache)
    if path.exists():
        _check(path.read_bytes(), str(path))
        return path
    data = fetch_mermaid(npm or shutil.which("npm"))
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)  # atomic: a concurrent build sees the whole file or none
    return path


def fetch_mermaid(npm: str | None) -> bytes:
    """``npm pack mermaid@VERSION``'s ``dist/mermaid.min.js``, its digests checked."""
    if npm is None:
        raise VendorError(
            f"the docs' diagrams need mermaid {MERMAID_VERSION} from the npm registry and "
            f"npm is not on PATH: install it (Debian: `apt-get install npm`) or put "
            f"{MERMAID_MEMBER} of `npm pack mermaid@{MERMAID_VERSION}` at {mermaid_path()}"
        )
    with tempfile.TemporaryDirectory(prefix="polar-mermaid-") as tmp:
        argv = [npm, "pack", f"mermaid@{MERMAID_VERSION}", "--ignore-scripts", "--json"]
        done = subprocess.run(
            [*argv, "--pack-destination", tmp], capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            raise VendorError(f"`{' '.join(argv)}` failed: {done.stderr.strip()[-600:]}")
        (tarball,) = Path(tmp).glob("mermaid-*.tgz")
        _check_integrity(tarball.read_bytes())
        with tarfile.open(tarball) as tar:
            member = tar.extractfile(MERMAID_MEMBER)
            if member is None:
                raise VendorError(f"{tarball.name} has no {MERMAID_MEMBER}")
            data = member.read()
    _check(data, MERMAID_MEMBER)
    return data


def _check_integrity(tarball: bytes) -> None:
    import base64

    got = "sha512-" + base64.b64encode(hashlib.sha512(tarball).digest()).decode()
    if got != MERMAID_INTEGRITY:
        raise VendorError(f"mermaid@{MERMAID_VERSION}'s tarball is not the pinned one: {got}")


def _check(data: bytes, where: str) -> None:
    got = hashlib.sha256(data).hexdigest()
    if got != MERMAID_SHA256:
        raise VendorError(
            f"{where} is not mermaid {MERMAID_VERSION}'s pinned build (sha256 {got}): "
            "delete it and build again"
        )
