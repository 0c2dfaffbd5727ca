"""Where a built session goes (the shared queue or its node's), and when a node's queue
counts as orphaned (held work nobody took) so another evaluator takes it over."""

from __future__ import annotations

from schemas import Outcome, TrajectoryBuilt
from schemas import subjects as S
from services.evaluator.config import EvaluatorConfig
from services.evaluator.orphans import Orphans, QueueLook, untaken


def built(**kw) -> TrajectoryBuilt:
    return TrajectoryBuilt(session_id="s1", task_id="t", outcome=Outcome.COMPLETED, **kw)


def test_a_runtime_left_on_a_node_sends_the_session_to_that_nodes_queue():
    assert built().subject == S.SESSIONS_BUILT_ANY
    assert built(node="g1").subject == S.SESSIONS_BUILT_ANY  # nothing left there
    on_g1 = built(node="g1", eval_runtime_id="s1-a0-main").subject
    assert on_g1 == "polar.sessions.built.node.g1" and S.built_node(on_g1) == "g1"
    # a finish without a node (an older executor's) keeps the old, shared route
    assert built(eval_runtime_id="s1-a0-main").subject == S.SESSIONS_BUILT_ANY
    assert S.built_node(S.SESSIONS_BUILT_ANY) is None
    assert S.built_node("polar.sessions.built.node.gw-1") == "gw-1"


def test_an_evaluator_reaches_its_own_node_unless_it_lists_others():
    assert EvaluatorConfig(node="g1").reachable_nodes == ("g1",)
    assert EvaluatorConfig(node="g1", nodes=("a", "b")).reachable_nodes == ("a", "b")


def q(node="g2", pending=1, ack=0, waiting=0, delivered=5) -> QueueLook:
    return QueueLook(node, pending, ack, waiting, delivered)


def test_untaken_means_work_waited_and_nobody_took_or_asked():
    assert untaken(q(), q())
    assert not untaken(q(), q(pending=0))  # nothing waits
    assert not untaken(q(), q(ack=1))  # one is being handled
    assert not untaken(q(), q(waiting=1))  # someone asks for work
    assert not untaken(q(delivered=4), q())  # something was taken since the last look


def test_a_queue_is_orphaned_after_the_whole_period_untaken():
    o = Orphans(after=60)
    assert o.look([q()], 0.0, own=("g1",)) == []  # first look: nothing to compare
    assert o.look([q()], 30.0, own=("g1",)) == []  # untaken for 30 s
    assert o.look([q()], 60.0, own=("g1",)) == ["g2"]  # 60 s since the first look
    o.taken("g2")
    assert o.look([q()], 61.0, own=("g1",)) == []  # drained: counts afresh


def test_progress_or_a_puller_resets_the_count():
    o = Orphans(after=60)
    o.look([q()], 0.0, own=())
    o.look([q(delivered=6)], 50.0, own=())  # its evaluator took one: alive
    assert o.look([q(delivered=6)], 100.0, own=()) == []  # untaken only since 50 s
    assert o.look([q(delivered=6)], 110.0, own=()) == ["g2"]
    o2 = Orphans(after=60)
    o2.look([q()], 0.0, own=())
    o2.look([q(waiting=1)], 30.0, own=())
    assert o2.look([q()], 70.0, own=()) == []


def test_own_nodes_are_never_taken_over_and_deleted_queues_are_forgotten():
    o = Orphans(after=1)
    o.look([q(node="g1"), q(node="g2")], 0.0, own=("g1",))
    assert o.look([q(node="g1"), q(node="g2")], 5.0, own=("g1",)) == ["g2"]
    o.look([], 6.0, own=("g1",))  # g2's consumer deleted
    assert o.look([q(node="g2")], 7.0, own=("g1",)) == []  # a new first look
