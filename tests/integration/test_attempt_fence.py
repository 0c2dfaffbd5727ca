"""A holder cut off past its lease comes back after its session was retried elsewhere:
finishing its old attempt must not move the new attempt to POSTRUN (found by the
multi-host test, tests/cluster: sessions stuck in POSTRUN, their builder skipping the
old attempt's SessionFinished while the new attempt's run could no longer finish)."""

from schemas import Artifacts, Outcome, SessionState
from services.common.finish import finish_session
from services.common.registry import Registry
from tests.helpers.stack import running_session


async def test_an_old_attempts_finish_leaves_the_new_attempt_running(redis_client, bus):
    reg = Registry(redis_client)
    (old,) = await running_session(reg, "fence-1")  # attempt 0, RUNNING on node0
    # the lease was lost: the reaper retried it (attempt 1) and it runs again elsewhere
    sid = old.session_id
    assert (await reg.transition(sid, SessionState.REGISTERED, attempt=1, node=None)).ok
    for st in (SessionState.INITIALIZING, SessionState.READY, SessionState.RUNNING):
        assert (await reg.transition(sid, st, node="node1")).ok
    done = await finish_session(reg, bus, old, 0, Outcome.COMPLETED, None, Artifacts(), None)
    assert done is False
    now = await reg.get_session(sid)
    assert (now.state, now.attempt, now.node) == (SessionState.RUNNING, 1, "node1")
    new = await reg.get_session(sid)
    assert await finish_session(reg, bus, new, 1, Outcome.COMPLETED, None, Artifacts(), None)
    assert (await reg.get_session(sid)).state == SessionState.POSTRUN
