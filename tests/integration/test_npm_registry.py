"""Versions the agent spec names as ranges or tags, resolved by the real npm registry
(``npm view``), the way a task's ``agent.version`` reaches an exact install."""

from __future__ import annotations

import pytest

from services.node.harnesses.npm import InstallError, is_exact, resolve_version
from tests.helpers.requires import requires_npm

pytestmark = [
    pytest.mark.harness,
    requires_npm,
]
PI = "@mariozechner/pi-coding-agent"  # its 0.73 line is pinned by the harness tests


async def test_an_exact_version_is_taken_as_it_is() -> None:
    assert await resolve_version(PI, "0.73.1") == "0.73.1"  # no registry call needed


async def test_a_range_and_a_tag_resolve_to_exact_published_versions() -> None:
    in_range = await resolve_version(PI, "~0.73.0")
    assert is_exact(in_range) and in_range.startswith("0.73.")
    assert int(in_range.split(".")[2]) >= 1  # 0.73.1 is published, so the newest is >= it
    latest = await resolve_version(PI, "latest")
    assert is_exact(latest)


async def test_a_range_nothing_matches_is_a_clear_error() -> None:
    with pytest.raises(InstallError, match="no version of .* matches '\\^999.0.0'"):
        await resolve_version(PI, "^999.0.0")
