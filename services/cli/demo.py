"""``polar demo --scripted``: the whole system, end to end, on embedded defaults.

Starts its own NATS and Valkey and every service on free ports (nothing of the user's is
touched), runs a real task — a calculator repository with a failing test, a stdlib-only
shell agent (infra/demo/agent.py) making tool calls through the proxy, 4 samples,
prefix_merging, test_on_output — shows progress and the results, exports the
trajectories, and stops everything it started. (``polar demo`` without ``--scripted`` is
the learning demo, ``services/demo/``.)
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import orjson
from rich.console import Console
from rich.table import Table

from infra import devstack, localservers
from infra.topology import parse_topology

DEMO = Path(__file__).resolve().parents[2] / "infra" / "demo"
SERVICES = ("model", "proxy", "scheduler", "pool", "executor", "builder", "evaluator", "dashboard")


def demo_topology(
    state_dir: Path,
    policy: Path = DEMO / "policy.yaml",
    *,
    engine: str = "",
    max_run: int = 4,
) -> str:
    """The demo's stack on free ports: ``policy`` the scripted policy the embedded model
    serves, ``engine`` extra model-server settings (YAML flow mapping items, e.g.
    ``threads: 2``), ``max_run`` sessions running at once."""
    ports = {name: localservers.free_port() for name in ("nats", "redis", *SERVICES)}
    proxy_url = f"http://127.0.0.1:{ports['proxy']}"
    work = state_dir / "work"
    node_cfg = f"{{work_dir: '{work}', proxy_url: '{proxy_url}'}}"
    model_cfg = f"policy: '{policy}', served_model_name: polar-tiny" + (
        f", {engine}" if engine else ""
    )
    return f"""
nats_url: nats://127.0.0.1:{ports["nats"]}
redis_url: redis://127.0.0.1:{ports["redis"]}/0
state_dir: '{state_dir}'
startup_timeout_seconds: 180
nodes: [{{name: node0, max_init: 2, ready_buffer: 2, max_run: {max_run}}}]
backends: [{{name: embedded, kind: embedded, url: 'http://127.0.0.1:{ports["model"]}'}}]
services:
  model: {{port: {ports["model"]}, config: {{{model_cfg}}}}}
  proxy: {{port: {ports["proxy"]}, config: {{mode: token}}}}
  scheduler: {{port: {ports["scheduler"]}}}
  pool: {{port: {ports["pool"]}, config: {node_cfg}}}
  executor: {{port: {ports["executor"]}, config: {node_cfg}}}
  builder: {{port: {ports["builder"]}}}
  evaluator: {{port: {ports["evaluator"]}, config: {node_cfg}}}
  dashboard: {{port: {ports["dashboard"]}}}
"""


def demo_task(task_id: str) -> dict:
    python = sys.executable  # has pytest; the sandbox sees the same host files
    bindir = str(Path(python).parent)
    return {
        "task_id": task_id,
        "instruction": "The calculator's tests fail. Find the bug in calc.py and fix it.",
        "num_samples": 4,
        "timeout_seconds": 600,
        "agent_timeout_seconds": 180,
        "runtime": {
            "backend": "local",
            "env": {"PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin"},
            "prepare": [
                {"action": "upload_dir", "src": str(DEMO / "calculator"), "dest": "."},
                {"action": "upload_file", "src": str(DEMO / "agent.py"), "dest": ".polar-agent.py"},
            ],
        },
        "agent": {
            "harness": "shell",
            "command": f"{python} .polar-agent.py",
            "model": "polar-tiny",
        },
        "builder": {"name": "prefix_merging"},
        "evaluator": {
            "name": "test_on_output",
            "runtime": "fresh",
            "config": {"test_command": f"{python} -m pytest -rA -q -p no:cacheprovider tests"},
        },
    }


def run(console: Console, keep: bool = False) -> int:
    state_dir = Path(tempfile.mkdtemp(prefix="polar-demo-"))
    topo = parse_topology(demo_topology(state_dir), "demo topology")
    console.rule("[bold]Polar demo")
    console.print(
        "Policy: [bold]scripted[/bold] (infra/demo/policy.yaml) served by the embedded "
        "CPU model server: replies are fixed by the script, emitted as token ids of the "
        "tiny model's real tokenizer, with logprobs from its (random) weights."
    )
    t0 = time.monotonic()
    devstack.up(topo, log=lambda m: console.print(f"  {m}", highlight=False))
    console.print(f"stack up in {time.monotonic() - t0:.1f}s; state in {state_dir}")
    try:
        urls = devstack.client_urls(state_dir, topo.nats_url, topo.redis_url)
        return asyncio.run(_run_task(console, *urls, state_dir))
    finally:
        if not keep:
            report = devstack.down(state_dir)
            console.print(f"stopped: {', '.join(report.stopped)}")


async def _run_task(console: Console, nats_url: str, redis_url: str, state_dir: Path) -> int:
    from services.cli import render
    from services.cli.submit import BusTasks
    from services.cli.taskfile import Submitted, TaskFile

    task_id = f"demo-{int(time.time())}"
    payload = orjson.dumps(demo_task(task_id))
    tasks = await BusTasks.open(nats_url, redis_url)
    try:
        answer = await tasks.submit(TaskFile(payload, task_id, 4), follow=True)
        if not isinstance(answer, Submitted):
            console.print(f"[red]task refused[/red]: {answer.reason}")
            return 1
        console.print(f"submitted task {task_id}: {len(answer.session_ids)} sessions")
        with render.SessionProgress(console, len(answer.session_ids), task_id) as progress:
            result = await tasks.wait(task_id, 300, progress.update)
    finally:
        await tasks.close()
    if result is None:
        console.print("[red]timed out[/red]")
        return 2
    console.print(render.results_table(result))
    trajectories = await _collect(nats_url, task_id, len(result.sessions))
    console.print(_trajectory_table(trajectories))
    out = state_dir / f"{task_id}.trajectories.jsonl"
    out.write_bytes(b"".join(orjson.dumps(t) + b"\n" for t in trajectories))
    console.print(
        f"trajectories: NATS subject polar.trajectories.{task_id} "
        f"(stream POLAR_TRAJECTORIES); a copy in {out}"
    )
    return 0 if result.status == "completed" else 1


async def _collect(nats_url: str, task_id: str, n: int) -> list[dict]:
    from schemas import subjects as S
    from services.common.bus import Bus

    bus = await Bus.open(nats_url, "polar-demo", declare=False)
    sub = await bus.js.subscribe(S.trajectories(task_id), ordered_consumer=True)
    found: dict[str, dict] = {}
    try:
        while len(found) < n:
            msg = await sub.next_msg(timeout=30)
            t = orjson.loads(await bus.payload(msg))
            found[t["session_id"]] = t
    finally:
        await sub.unsubscribe()
        await bus.close()
    return [found[k] for k in sorted(found)]


def _trajectory_table(trajectories: list[dict]) -> Table:
    table = Table(title="trajectories (prefix_merging)")
    for col in (
        "session",
        "reward",
        "chains",
        "trainer tokens",
        "sampled",
        "merge ratio",
        "breaks",
    ):
        table.add_column(col)
    for t in trajectories:
        st = t.get("stats", {})
        table.add_row(
            t["session_id"],
            str(t.get("reward")),
            str(st.get("chains", 0)),
            str(st.get("tokens", 0)),
            str(st.get("sampled_tokens", 0)),
            f"{st.get('merge_ratio', 1.0):.2f}x",
            ", ".join(f"{k}:{v}" for k, v in st.get("breaks", {}).items()) or "-",
        )
    return table
