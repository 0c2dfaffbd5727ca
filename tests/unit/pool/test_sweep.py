"""The start-up sweep's decision, as a plain function: which runtimes in a node's work dir a
restarted pool or executor keeps, stops, or removes the files of."""

import msgspec
import pytest

from schemas import Session, SessionState
from schemas.task import EvaluatorSpec
from services.node.reaper import FILES, KEEP, STOP, leftover_action

ST = SessionState


class Spec(msgspec.Struct):
    evaluator: EvaluatorSpec = EvaluatorSpec()


LIVE_EVAL = Spec(EvaluatorSpec(name="m:Judge", runtime="live"))


def session(state: ST, node: str | None = "node0") -> Session:
    return Session(session_id="t-0000", task_id="t", index=0, token="x", state=state, node=node)


@pytest.mark.parametrize(
    ("state", "node", "role", "spec", "leased", "admitting", "action"),
    [
        # Held: by a live holder, or by a dead one whose lease a reaper here will take.
        (ST.RUNNING, "node0", "main", Spec(), True, False, KEEP),
        (ST.ERROR, "node0", "main", Spec(), True, False, KEEP),  # cancelled in READY
        (ST.INITIALIZING, "node0", "main", Spec(), False, False, KEEP),  # just admitted
        (ST.READY, "node0", "main", Spec(), False, True, KEEP),
        # Ended: nobody will stop it.
        (ST.ERROR, "node0", "main", Spec(), False, False, STOP),
        (ST.COMPLETED, "node0", "eval", Spec(), False, True, STOP),
        (ST.CANCELLED, None, "main", Spec(), False, True, STOP),
        # After the run, the evaluator may use the eval runtime or the kept live one.
        (ST.POSTRUN, "node0", "eval", Spec(), False, False, KEEP),
        (ST.EVALUATING, "node0", "main", LIVE_EVAL, False, False, KEEP),
        (ST.POSTRUN, "node0", "main", Spec(), False, False, STOP),  # not kept
        (ST.BUILDING, "node0", "main", None, False, False, STOP),  # task gone
        # An earlier attempt's: the session goes on, maybe on another node of this host.
        (ST.RUNNING, "node1", "main", Spec(), False, False, FILES),
        (ST.POSTRUN, "node1", "eval", Spec(), False, False, FILES),
        (ST.REGISTERED, None, "main", Spec(), False, False, FILES),  # the pool sweeps first
        (ST.REGISTERED, None, "main", Spec(), False, True, KEEP),  # a pool may admit it now
    ],
)
def test_leftover_action(state, node, role, spec, leased, admitting, action):
    got = leftover_action(session(state, node), role, spec, "node0", leased, admitting=admitting)
    assert got == action


def test_a_runtime_whose_session_is_gone_is_stopped():
    assert leftover_action(None, "main", None, "node0", False, admitting=True) == STOP
