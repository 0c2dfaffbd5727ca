"""`polar status` parts that need no server: heartbeat rows and what gets printed."""

from rich.console import Console

from schemas import NodeHeartbeat, SessionResult, SessionState, TaskResult, encode
from services.cli import render
from services.cli.status import (
    ConsumerRow,
    NodeRow,
    ServiceHealth,
    StatusReport,
    StreamRow,
    node_rows,
)


def test_node_rows_from_heartbeats():
    hb = NodeHeartbeat(
        ts=100.0, node="n1", service="pool", stages={"INIT": 2}, capacity={"INIT": 4}
    )
    rows = node_rows({b"n1": encode(hb), b"n0": b"garbage"}, now=103.5)
    assert rows == [
        NodeRow(node="n0", service="?", age_seconds=None),
        NodeRow(
            node="n1", service="pool", age_seconds=3.5, stages={"INIT": 2}, capacity={"INIT": 4}
        ),
    ]


def printed(*renderables) -> str:
    console = Console(record=True, width=200)
    for r in renderables:
        console.print(r)
    return console.export_text()


def test_status_prints_every_part_and_errors():
    report = StatusReport(
        nats_url="nats://n",
        redis_url="redis://r",
        stack_record=None,
        services=[
            ServiceHealth(name="scheduler", url="http://s", pid=7, status=200, detail={}),
            ServiceHealth(
                name="pool-node0",
                url="http://p",
                pid=8,
                status=503,
                detail={"checks": {"nats": False}},
            ),
        ],
        nodes=[NodeRow(node="node0", service="pool", age_seconds=1.0, stages={"READY": 3})],
        streams=[
            StreamRow(
                name="POLAR_TASKS",
                messages=5,
                consumers=[
                    ConsumerRow(name="scheduler-submit", pending=2, ack_pending=1, redelivered=0)
                ],
            ),
            StreamRow(name="POLAR_DLQ", messages=None),
        ],
        sessions={"RUNNING": 2, "REGISTERED": 1},
        errors=["cannot reach Redis at redis://r: refused"],
    )
    console = Console(record=True, width=200)
    render.print_status(console, report)
    text = console.export_text()
    for expected in (
        "healthy",
        "unhealthy 503 {'nats': False}",
        "READY 3",
        "scheduler-submit",
        "not created",
        "cannot reach Redis",
        "not started by polar up",
    ):
        assert expected in text, expected
    assert text.index("REGISTERED") < text.index("RUNNING")  # lifecycle order


def test_results_table_lists_every_session():
    result = TaskResult(
        task_id="t1",
        status="completed",
        num_samples=2,
        mean_reward=0.5,
        sessions=[
            SessionResult(session_id="t1-0000", state=SessionState.COMPLETED, reward=1.0),
            SessionResult(session_id="t1-0001", state=SessionState.ERROR, reason="sandbox died"),
        ],
    )
    text = printed(render.results_table(result))
    assert "task t1: completed, mean reward 0.5" in text
    assert "t1-0000" in text and "sandbox died" in text


def test_stage_usage_shows_bounds():
    from services.cli.render import stage_usage

    assert stage_usage({"INIT": 3, "READY": 2, "QUEUED": 7}, {"INIT": 4, "READY": 4}) == (
        "INIT 3/4  READY 2/4  QUEUED 7"
    )
    assert stage_usage({}, {}) == "-"
