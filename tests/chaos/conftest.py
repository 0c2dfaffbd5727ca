"""The chaos table in the terminal summary: `just test` does not pass ``-s``."""

import pytest

TABLE = pytest.StashKey[list[str]]()


@pytest.fixture
def chaos_report(request) -> list[str]:
    """Lines a chaos test adds here are printed at the end of the run."""
    return request.config.stash.setdefault(TABLE, [])


def pytest_terminal_summary(terminalreporter, config) -> None:
    lines = config.stash.get(TABLE, [])
    if lines:
        terminalreporter.section("chaos fault table")
        for line in lines:
            terminalreporter.write_line(line)
