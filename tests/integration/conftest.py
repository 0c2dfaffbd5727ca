"""Fixtures the proxy's integration modules share."""

from __future__ import annotations

import pytest

from tests.helpers.stack import embedded_engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The embedded engine with the long tool-loop policy, one per module (a module may
    swap its weights). A module that needs another engine defines its own ``engine``."""
    with embedded_engine("tool_loop.yaml", tmp_path_factory.mktemp("e")) as srv:
        yield srv
