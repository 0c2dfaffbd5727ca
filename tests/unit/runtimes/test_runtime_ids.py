"""Runtime ids name a session's attempt and role, and parse back exactly (the start-up
sweep reads them from a node's work dir), whatever '-' the session id holds."""

from types import SimpleNamespace

import pytest

from schemas.task import LocalRuntime
from services.node.session import node_runtime
from services.runtimes.errors import SandboxConfigError
from services.runtimes.factory import RuntimeName, parse_runtime_id, runtime_id_for


@pytest.mark.parametrize(
    ("session_id", "attempt", "role", "runtime_id"),
    [
        ("t-0000", 0, "main", "t-0000-a0-main"),
        ("t-0000", 12, "eval", "t-0000-a12-eval"),
        # session ids hold '-', and parts that look like an attempt or a role
        ("run-a1-main-0003", 1, "main", "run-a1-main-0003-a1-main"),
        ("x-a7-eval-a2-0000", 3, "eval", "x-a7-eval-a2-0000-a3-eval"),
        ("a-a0", 0, "main", "a-a0-a0-main"),
        ("-", 4, "x9", "--a4-x9"),
    ],
)
def test_an_id_parses_back_to_what_made_it(session_id, attempt, role, runtime_id):
    assert runtime_id_for(session_id, attempt, role) == runtime_id
    assert parse_runtime_id(runtime_id) == RuntimeName(session_id, attempt, role)


def test_the_attempts_of_a_session_have_their_own_ids():
    ids = {runtime_id_for("t-0000", n, role) for n in range(3) for role in ("main", "eval")}
    assert len(ids) == 6


@pytest.mark.parametrize(
    "name",
    [
        "t-0000-main",  # from before ids had attempts
        "t-0000-eval",
        "t-0000-a-main",  # no attempt number
        "t-0000-a01-main",  # not as runtime_id_for writes it
        "t-0000-ax-main",
        "t-0000-a1-",  # no role
        "t-0000-a1-Main",  # not a role
        "t-0000-a1-main-",
        "-a1-main",  # no session
        "a1-main",
        "",
    ],
)
def test_a_name_runtime_id_for_cannot_make_does_not_parse(name):
    assert parse_runtime_id(name) is None


@pytest.mark.parametrize(("attempt", "role"), [(-1, "main"), (0, "Main"), (0, "a-b"), (0, "")])
def test_an_attempt_or_role_that_would_not_parse_back_is_refused(attempt, role):
    with pytest.raises(SandboxConfigError):
        runtime_id_for("t-0000", attempt, role)


def test_a_new_runtime_of_a_node_is_named_by_its_attempt(tmp_path):
    config = SimpleNamespace(work_dir=str(tmp_path), proxy_url=None, docker_host=None)
    rt = node_runtime(config, LocalRuntime(), "t-0000", attempt=3, role="eval")
    assert rt.runtime_id == "t-0000-a3-eval" and rt.state == "new"
    with pytest.raises(ValueError, match="attempt"):
        node_runtime(config, LocalRuntime(), "t-0000")  # whose attempt? none said
    adopted = node_runtime(config, LocalRuntime(), "t-0000", "t-0000-a3-eval")
    assert adopted.runtime_id == "t-0000-a3-eval"
