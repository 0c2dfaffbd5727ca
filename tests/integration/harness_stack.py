"""The whole stack for the real-CLI harness tests, and what those tests read back.

One stack (NATS, Valkey, embedded model with a scripted policy, proxy in token mode,
scheduler, pool, executor, builder, evaluator) on free ports, as ``polar demo`` starts
it. The CLIs come from npm into a cache that outlives the test run
(``$POLAR_TEST_HARNESS_CACHE``, default ``<repo>/.state/harness-cache``), so only the
first run downloads. Gateways between a CLI and the proxy make its streams fail the
way real gateways do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import yaml
from aiohttp import ClientSession, ClientTimeout, web

from infra import devstack, localservers
from infra.setup import LEGACY_PI  # the pi that exits 0 after a failed stream
from infra.topology import parse_topology
from schemas import CompletionRecord, SessionFinished, SessionStateChanged, TaskResult, decode
from schemas import subjects as S
from services.node.harnesses import CLI_PRESETS
from services.node.harnesses.npm import Installed
from tests.helpers.streams import stored_messages

REPO = Path(__file__).resolve().parents[2]
POLICIES = REPO / "tests" / "fixtures" / "policies"
MODEL = "polar-tiny"
SERVICES = ("model", "proxy", "scheduler", "pool", "executor", "builder", "evaluator", "dashboard")


# task id -> (preset, agent overrides, Polar protocol). The core set runs every CLI and
# every protocol (and the Claude fallback, the Gemini router) in `just test`; the full
# matrix (`just test-harness`: every protocol of each multi-protocol CLI) adds five more
# sessions, about two minutes on two cores, over CI's time budget.
CORE = {
    "codex": ("codex", {}, "openai_responses"),
    "claude-stream": ("claude_code", {}, "anthropic_messages"),
    "claude-fallback": ("claude_code", {}, "anthropic_messages"),
    "gemini": ("gemini_cli", {}, "gemini"),
    "gemini-router": ("gemini_cli", {"model": "auto"}, "gemini"),  # Gemini CLI routes first
    "qwen-openai": ("qwen_code", {"protocol": "openai"}, "openai_chat"),
    "opencode": ("opencode", {}, "openai_chat"),
    "pi-completions": ("pi", {"protocol": "openai-completions"}, "openai_chat"),
}


def cache_dir() -> Path:
    default = REPO / ".state" / "harness-cache"
    return Path(os.environ.get("POLAR_TEST_HARNESS_CACHE", default)).absolute()


async def preinstall(cache: Path) -> dict[str, Installed]:
    """Install (or find) every CLI the tests run, and the legacy pi, in the cache."""
    from services.node.harnesses.preinstall import preinstall as fill

    got = await fill(cache, [*CLI_PRESETS, f"pi@{LEGACY_PI}"])
    return {g.package.spec: g for g in got}


def combined_policy(dest: Path, pattern: str = "harness_*.yaml") -> Path:
    """The per-harness scripts (``pattern`` in tests/fixtures/policies) as one (every turn
    is chosen by a regex)."""
    turns, default = [], None
    for path in sorted(POLICIES.glob(pattern)):
        script = yaml.safe_load(path.read_text())
        turns += script["turns"]
        default = script.get("default", default)
    dest.write_text(yaml.safe_dump({"turns": turns, "default": default}))
    return dest


def topology(
    root: Path,
    policy: Path | None,
    max_run: int,
    *,
    backend: dict | None = None,
    proxy: dict | None = None,
) -> tuple[str, str]:
    """(the proxy's URL, topology YAML). ``backend``: a served engine (a ``backends``
    entry, e.g. ``kind: vllm``) in place of the embedded model scripted by ``policy``;
    ``proxy``: the proxy's config over ``mode: token``."""
    ports = {name: localservers.free_port() for name in ("nats", "redis", *SERVICES)}
    proxy_url = f"http://127.0.0.1:{ports['proxy']}"
    node = f"{{work_dir: '{root / 'work'}', proxy_url: '{proxy_url}'}}"
    if backend is None:
        # Long CLI prompts (12k-31k tokens): one prefill chunk, and room to keep every
        # session's prompt cached so the next call of a session only computes its tail.
        engine = "{max_prefill_tokens: 32768, prefix_cache_tokens: 600000}"
        config = f"{{policy: '{policy}', served_model_name: {MODEL}, threads: 2, engine: {engine}}}"
        model = f"{{port: {ports['model']}, config: {config}}}"
        backend = {
            "name": "embedded",
            "kind": "embedded",
            "url": f"http://127.0.0.1:{ports['model']}",
        }
    else:
        model = "{enabled: false}"
    proxy_config = json.dumps({"mode": "token", **(proxy or {})})  # JSON is YAML
    return (
        proxy_url,
        f"""
nats_url: nats://127.0.0.1:{ports["nats"]}
redis_url: redis://127.0.0.1:{ports["redis"]}/0
state_dir: '{root / "state"}'
startup_timeout_seconds: 180
nodes: [{{name: node0, max_init: 4, ready_buffer: 4, max_run: {max_run}}}]
backends: [{json.dumps(backend)}]
services:
  model: {model}
  proxy: {{port: {ports["proxy"]}, config: {proxy_config}}}
  scheduler: {{port: {ports["scheduler"]}}}
  pool: {{port: {ports["pool"]}, config: {node}}}
  executor: {{port: {ports["executor"]}, config: {node}}}
  builder: {{port: {ports["builder"]}}}
  evaluator: {{port: {ports["evaluator"]}, config: {node}}}
  dashboard: {{port: {ports["dashboard"]}}}
""",
    )


def harness_task(task_id: str, harness: str, **agent) -> dict:
    """A task for ``harness``: write proof.txt through its shell tool; the ``command``
    evaluator gives 1.0 when the file holds the scripted content."""
    short = harness.split("_")[0]
    # a cap, not a measure: 13 CLIs at once prefill ~20k-token prompts on the CPU engine,
    # and on a slow 2-core machine the batch has taken 10 minutes (3 CLIs past 300 s)
    timeout = agent.pop("agent_timeout", 600)
    # a gateway or a dead port of the node stands in for the proxy: the sandbox must reach
    # the node's ports for it (isolated by default, it reaches only its own proxy route)
    via_node = "proxy_url" in agent.get("settings", {})
    return {
        "task_id": task_id,
        "instruction": f"[polar-harness:{harness}] Create proof.txt holding polar-{short}.",
        "num_samples": 1,
        "timeout_seconds": 900,
        "agent_timeout_seconds": timeout,
        "runtime": {"backend": "local", **({"network": "host"} if via_node else {})},
        "agent": {"harness": harness, "model": MODEL, **agent},
        "builder": {"name": "prefix_merging"},
        "evaluator": {
            "name": "command",
            "config": {"command": f"grep -qx polar-{short} proof.txt && echo 1 || echo 0"},
        },
    }


@dataclass
class TaskRun:
    """Everything one finished task left: result, session end, trajectory, model calls."""

    task_id: str
    result: TaskResult
    finished: SessionFinished | None
    trajectory: dict
    records: list[CompletionRecord]
    entered: dict[str, float]  # state -> when the session entered it

    def stage_seconds(self, start: str, end: str) -> float | None:
        """Seconds between entering two states (INITIALIZING -> READY: INIT;
        RUNNING -> POSTRUN: the harness run)."""
        a, b = self.entered.get(start), self.entered.get(end)
        return round(b - a, 1) if a and b else None

    @property
    def session(self):
        return self.result.sessions[0]

    @property
    def main_traces(self) -> list[dict]:
        return [t for t in self.trajectory.get("traces", []) if not t.get("side_call")]

    @property
    def side_traces(self) -> list[dict]:
        return [t for t in self.trajectory.get("traces", []) if t.get("side_call")]

    @property
    def wall_seconds(self) -> float:
        return self.result.finished_at - self.result.submitted_at

    def proxy_ms(self) -> list[tuple[float, float]]:
        """(whole call, engine) milliseconds per model call, as the proxy timed them."""
        out = []
        for r in self.records:
            t = r.timings
            if t is not None:
                whole = (t.captured - t.received) * 1000
                out.append((whole, (t.upstream_end - t.upstream_start) * 1000))
        return out


@dataclass
class Stack:
    root: Path
    topo: object
    proxy_url: str
    topology_text: str = ""  # what the topology file of ``polar`` commands would hold
    finished: dict[str, SessionFinished] = field(default_factory=dict)
    # session id -> {state: epoch seconds it was entered}
    entered: dict[str, dict[str, float]] = field(default_factory=dict)

    @classmethod
    def up(
        cls,
        root: Path,
        *,
        max_run: int = 3,
        policies: str = "harness_*.yaml",
        backend: dict | None = None,
        proxy: dict | None = None,
    ) -> Stack:
        """The stack on the embedded model scripted by ``policies``, or on ``backend``."""
        policy = None if backend else combined_policy(root / "harness_policy.yaml", policies)
        proxy_url, text = topology(root, policy, max_run, backend=backend, proxy=proxy)
        topo = parse_topology(text, "harness topology")
        devstack.up(topo)
        return cls(root, devstack.operator_view(topo), proxy_url, text)

    def down(self) -> None:
        devstack.down(devstack.state_dir_of(self.topo))

    async def run(self, tasks: list[dict], timeout: float = 900) -> dict[str, TaskRun]:
        """Submit every task at once, wait for all results, read back what they left."""
        from services.cli.submit import BusTasks
        from services.cli.taskfile import Submitted, TaskFile
        from services.common.bus import Bus

        bus = await Bus.open(self.topo.nats_url, "harness-tests", declare=False)
        subs = [
            await bus.nc.subscribe(S.SESSIONS_FINISHED, cb=self._on_finished(bus)),
            await bus.nc.subscribe(S.session_event("*"), cb=self._on_state(bus)),
        ]
        clients = []
        try:
            for task in tasks:
                client = await BusTasks.open(self.topo.nats_url, self.topo.redis_url)
                clients.append(client)
                # follow: the task's result arrives on a subscription made before submit
                answer = await client.submit(TaskFile(orjson.dumps(task), task["task_id"], 1), True)
                assert isinstance(answer, Submitted), answer
            results = await asyncio.gather(
                *(
                    c.wait(t["task_id"], timeout, _ignore)
                    for c, t in zip(clients, tasks, strict=True)
                )
            )
            runs = {}
            for task, result in zip(tasks, results, strict=True):
                assert result is not None, f"{task['task_id']}: no result in {timeout}s"
                runs[task["task_id"]] = await self._read_back(bus, result)
            return runs
        finally:
            for sub in subs:
                await sub.unsubscribe()
            for c in clients:
                await c.close()
            await bus.close()

    def _on_finished(self, bus):
        async def on_msg(msg) -> None:
            with contextlib.suppress(Exception):
                ev = decode(await bus.payload(msg), SessionFinished)
                self.finished[ev.session_id] = ev

        return on_msg

    def _on_state(self, bus):
        async def on_msg(msg) -> None:
            with contextlib.suppress(Exception):
                ev = decode(await bus.payload(msg), SessionStateChanged)
                self.entered.setdefault(ev.session_id, {})[str(ev.to_state)] = ev.ts

        return on_msg

    async def _read_back(self, bus, result: TaskResult) -> TaskRun:
        sid = result.sessions[0].session_id
        trajectory = (await read_stream(bus, S.trajectories(result.task_id), 1, 60))[0]
        records = [
            decode(raw, CompletionRecord)
            for raw in await read_stream(bus, S.completions(sid), None, 60)
        ]
        return TaskRun(
            result.task_id,
            result,
            self.finished.get(sid),
            orjson.loads(trajectory),
            records,
            self.entered.get(sid, {}),
        )


def assert_one_exact_chain(run: TaskRun, harness: str, protocol: str) -> None:
    """What every scripted CLI session must leave: completed with reward 1 (the CLI ran
    the scripted command and printed the scripted answer), from the node's cache, every
    call in ``protocol``, the main calls one chain whose loss-masked tokens are exactly
    the sampled ones, side calls tagged in traces of their own."""
    stderr = run.finished and run.finished.artifacts.stderr_tail[-1500:]
    why = f"{run.task_id}: {run.session.reason} | {stderr}"
    assert run.session.state == "COMPLETED", why
    assert run.session.reward == 1.0, why

    # the CLI ran the scripted command and printed the scripted final answer
    assert "POLAR-FINAL: proof.txt written by" in run.finished.artifacts.stdout_tail, why

    # every trajectory records harness, CLI version and protocol
    t = run.trajectory
    assert (t["harness"], t["protocol"]) == (harness, protocol)
    assert t["harness_version"] == CLI_PRESETS[harness].default_version
    install = json.loads(run.finished.artifacts.logs["logs/harness.json"])
    assert install["cached"] is True and install["source"] == "node_cache", install

    # every model call spoke the variant's protocol; main calls are one exact chain
    assert {str(r.protocol) for r in run.records} == {protocol}
    main = [r for r in run.records if r.side_call is None]
    assert len(main) >= 2, [r.seq for r in run.records]  # the tool call, then the answer
    assert len(run.main_traces) == 1, [tr.get("break_reason") for tr in run.main_traces]
    trace = run.main_traces[0]
    assert trace["completion_seqs"] == [r.seq for r in main]
    follows = [r for r in main[1:] if _follows_main(r, run.records)]
    assert all(r.extends_previous for r in follows), [(r.seq, r.drift_reason) for r in follows]
    sampled = [tok for r in main for tok in r.output_ids]
    kept = [tok for tok, m in zip(trace["response_ids"], trace["loss_mask"], strict=True) if m]
    assert kept == sampled  # the trainer gets exactly the sampled tokens, mask 1 on them
    for side in run.side_traces:  # side calls stay out of the main chain, tagged
        assert side["break_reason"] == f"side_call:{side['side_call']}"


def _follows_main(rec: CompletionRecord, records: list[CompletionRecord]) -> bool:
    before = [r for r in records if r.seq < rec.seq]
    return bool(before) and before[-1].side_call is None


def _ignore(*_: object) -> None:
    return None


async def read_stream(bus, subject: str, count: int | None, timeout: float) -> list[bytes]:
    """The payloads of ``subject``'s stored messages (``stored_messages``)."""
    return [await bus.payload(m) for m in await stored_messages(bus, subject, count, timeout)]


# -- gateways between a CLI and the proxy ----------------------------------------------
class Gateway:
    """An HTTP hop in front of the proxy. ``no_stream``: a streaming request gets an
    event stream with no events (the CLI never sees ``message_start``), anything else is
    forwarded. ``strip_events``: everything is forwarded, ``event:`` lines are dropped
    from streams (what HARNESSES.md saw break CLIs)."""

    def __init__(self, target: str, mode: str) -> None:
        assert mode in ("no_stream", "strip_events")
        self.target, self.mode = target.rstrip("/"), mode
        self.port = localservers.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.seen: list[tuple[str, bool]] = []  # (path, streaming) per request
        self._runner: web.AppRunner | None = None

    async def start(self) -> Gateway:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        streaming = _is_streaming(body)
        self.seen.append((request.path, streaming))
        if streaming and self.mode == "no_stream":
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b": no events here\n\n")
            await resp.write_eof()
            return resp
        return await self._forward(request, body)

    async def _forward(self, request: web.Request, body: bytes) -> web.StreamResponse:
        skip = {"host", "content-length", "accept-encoding"}
        headers = {k: v for k, v in request.headers.items() if k.lower() not in skip}
        url = self.target + request.path_qs
        async with (
            ClientSession(timeout=ClientTimeout(total=900)) as session,
            session.request(request.method, url, data=body, headers=headers) as up,
        ):
            ctype = up.headers.get("content-type", "application/json")
            if "text/event-stream" not in ctype:
                data = await up.read()
                return web.Response(status=up.status, body=data, headers={"content-type": ctype})
            return await self._relay_stream(request, up, ctype)

    async def _relay_stream(self, request: web.Request, up, ctype: str) -> web.StreamResponse:
        resp = web.StreamResponse(status=up.status, headers={"content-type": ctype})
        await resp.prepare(request)
        rest = b""
        async for chunk in up.content.iter_any():
            *lines, rest = (rest + chunk).split(b"\n")
            kept = b"".join(x + b"\n" for x in lines if not x.startswith(b"event:"))
            if kept:
                await resp.write(kept)
        await resp.write_eof()
        return resp


def _is_streaming(body: bytes) -> bool:
    try:
        data = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        return False
    return isinstance(data, dict) and bool(data.get("stream"))


class BlackHole:
    """Accepts connections and never answers: a model endpoint that hangs."""

    def __init__(self) -> None:
        self.port = localservers.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.connections = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> BlackHole:
        self._server = await asyncio.start_server(self._hold, "127.0.0.1", self.port)
        return self

    async def _hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        with contextlib.suppress(Exception):
            while await reader.read(65536):
                pass
        writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()


def closed_port_url() -> str:
    """A loopback URL nothing listens on: a model endpoint that refuses connections."""
    return f"http://127.0.0.1:{localservers.free_port()}"


def since(t0: float) -> float:
    return round(time.monotonic() - t0, 1)


def harness_marks():
    """The marks of a test module that runs the real CLIs through a whole stack."""
    import pytest

    from tests.helpers.requires import requires_npm

    return [pytest.mark.harness, pytest.mark.timeout(1500), requires_npm]  # npm installs the CLIs
