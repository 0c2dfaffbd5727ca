"""The start-up sweep's decision, as a plain function: which runtimes in a node's work dir a
restarted pool or executor keeps, stops, or removes the files of."""

import msgspec
import pytest

from schemas import Session, SessionState
from schemas.task import EvaluatorSpec
from services.node.reaper import FILES, KEEP, STOP, leftover_action
from services.runtimes.factory import RuntimeName

ST = SessionState


class Spec(msgspec.Struct):
    evaluator: EvaluatorSpec = EvaluatorSpec()


LIVE_EVAL = Spec(EvaluatorSpec(name="m:Judge", runtime="live"))


def session(state: ST, node: str | None = "node0", attempt: int = 1) -> Session:
    return Session(
        session_id="t-0000", task_id="t", index=0, token="x", state=state, node=node,
        attempt=attempt,
    )  # fmt: skip


def name(role: str = "main", attempt: int = 1) -> RuntimeName:
    return RuntimeName("t-0000", attempt, role)


@pytest.mark.parametrize(
    ("state", "node", "role", "spec", "leased", "action"),
    [
        # Held: by a live holder, or by a dead one whose lease a reaper here will take.
        (ST.RUNNING, "node0", "main", Spec(), True, KEEP),
        (ST.ERROR, "node0", "main", Spec(), True, KEEP),  # cancelled in READY
        (ST.INITIALIZING, "node0", "main", Spec(), False, KEEP),  # just admitted
        (ST.READY, "node0", "main", Spec(), False, KEEP),
        # Ended: nobody will stop it.
        (ST.ERROR, "node0", "main", Spec(), False, STOP),
        (ST.COMPLETED, "node0", "eval", Spec(), False, STOP),
        (ST.CANCELLED, None, "main", Spec(), False, STOP),
        # After the run, the evaluator may use the eval runtime or the kept live one.
        (ST.POSTRUN, "node0", "eval", Spec(), False, KEEP),
        (ST.EVALUATING, "node0", "main", LIVE_EVAL, False, KEEP),
        (ST.POSTRUN, "node0", "main", Spec(), False, STOP),  # not kept
        (ST.BUILDING, "node0", "main", None, False, STOP),  # task gone
        # The registry has this attempt on another node: its tag may be on that node's
        # processes of this host.
        (ST.RUNNING, "node1", "main", Spec(), False, FILES),
        (ST.POSTRUN, "node1", "eval", Spec(), False, FILES),
    ],
)
def test_the_current_attempts_runtime(state, node, role, spec, leased, action):
    assert leftover_action(session(state, node), name(role), spec, "node0", leased) == action


@pytest.mark.parametrize(
    ("state", "node", "role", "leased"),
    [
        (ST.RUNNING, "node0", "main", True),  # the next attempt runs here, leased
        (ST.INITIALIZING, "node0", "main", False),  # the next attempt just admitted here
        (ST.READY, "node1", "main", True),
        (ST.REGISTERED, None, "main", False),  # retried, not admitted yet
        (ST.POSTRUN, "node0", "eval", False),  # the next attempt's evaluation
        (ST.EVALUATING, "node0", "main", False),
    ],
)
def test_an_earlier_attempts_runtime_is_stopped_whatever_the_next_one_does(
    state, node, role, leased
):
    """Its id is its own: stopping it cannot touch the next attempt's runtime, even on
    this node (before ids had attempts, both were ``<session>-main``)."""
    got = leftover_action(
        session(state, node, attempt=2), name(role, 1), LIVE_EVAL, "node0", leased
    )
    assert got == STOP


def test_a_runtime_whose_session_is_gone_is_stopped():
    assert leftover_action(None, name(), None, "node0", False) == STOP
