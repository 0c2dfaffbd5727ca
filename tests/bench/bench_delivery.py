"""Delivery benchmark: evaluator throughput (score + exactly-once publish + final CAS) and
trainer-client group throughput, on its own nats-server and Valkey. Plain script:

    python tests/bench/bench_delivery.py [--sessions 400] [--group 8] [--tokens 2000]

Sessions use the ``session_completed`` evaluator (no runtime), so what is measured is
the service's own cost per session: object-store read, kept result in Redis, publish
with dedupe id, CAS transition, SessionScored; then a client reading whole groups and
committing them.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from infra import localservers  # noqa: E402
from schemas import TaskRequest  # noqa: E402
from services.client import TrajectoryClient  # noqa: E402
from services.common.bus import Bus  # noqa: E402
from services.common.registry import Registry  # noqa: E402
from services.evaluator.config import EvaluatorConfig  # noqa: E402
from services.evaluator.handlers import EvaluatorService  # noqa: E402
from services.evaluator.main import consumers  # noqa: E402
from tests.unit.evaluators.sessions import announce, new_sessions, unscored  # noqa: E402


async def prepare(bus, reg, sessions: int, group: int, tokens: int) -> list[str]:
    tasks = []
    for g in range(sessions // group):
        task_id = f"bench-{g:04d}"
        sids = await new_sessions(
            reg, TaskRequest(task_id=task_id, instruction="x", num_samples=group)
        )
        for sid in sids:
            await announce(bus, unscored(sid, task_id, tokens=tokens))
        tasks.append(task_id)
    return tasks


async def run(args, nats_url: str, redis_url: str, work: Path) -> None:
    bus = await Bus.open(nats_url, "bench")
    reg = Registry.from_url(redis_url)
    tasks = await prepare(bus, reg, args.sessions, args.group, args.tokens)
    n = len(tasks) * args.group
    service = EvaluatorService(
        bus, reg, EvaluatorConfig(work_dir=str(work), concurrency=args.concurrency)
    )
    start = time.perf_counter()
    for c in consumers(service):
        await c.run(drain=True)
    dt = time.perf_counter() - start
    print(f"evaluator: {n} sessions in {dt:.2f}s = {n / dt:.0f} sessions/s "
          f"(concurrency {args.concurrency}, {args.tokens} response tokens each)")  # fmt: skip

    client = await TrajectoryClient(nats_url, durable="bench", poll_seconds=0.5).connect()
    start, groups, members = time.perf_counter(), 0, 0
    async for g in client.groups(stop_when_idle=True):
        await g.commit()
        groups += 1
        members += len(g.items)
    dt = time.perf_counter() - start - 0.5  # the last, empty poll
    print(f"client: {groups} groups ({members} trajectories) read and committed in {dt:.2f}s "
          f"= {members / dt:.0f} trajectories/s")  # fmt: skip
    await client.close()
    await reg.close()
    await bus.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=400)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="polar-bench-delivery-"))
    nats_port, valkey_port = localservers.free_port(), localservers.free_port()
    nats = localservers.start_nats(nats_port, root / "nats")
    valkey = localservers.start_valkey(valkey_port, root / "valkey")
    try:
        nats_url = f"nats://127.0.0.1:{nats_port}"
        redis_url = f"redis://127.0.0.1:{valkey_port}/0"
        asyncio.run(run(args, nats_url, redis_url, root / "work"))
    finally:
        localservers.stop_process(nats.pid)
        localservers.stop_process(valkey.pid)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
