"""The six CLI presets, real CLIs from npm, through the whole stack.

scheduler -> pool (installs from the node's cache, configures) -> executor (runs the CLI
headless) -> proxy (token mode) -> embedded engine (scripted policy: each CLI's own shell
tool) -> builder (prefix_merging) -> evaluator (``command``: proof.txt holds what the
script wrote). Every variant runs as its own task, all at once on one stack; then each
test reads its task's result, trajectory and captured calls. Failures (a crash, a hang,
a model nobody can reach, a CLI that exits 0 after a failed call) run in the same batch:
the stack ends them with the right state and reason while the others complete.

This covers issue 4's real-harness smoke test too: Codex and Claude Code (streaming, and
its non-streaming fallback behind a gateway whose streams carry no events) run the
scripted shell command and print the scripted final answer.
"""

from __future__ import annotations

import json
import os
import sys

import orjson
import pytest

from schemas import Outcome
from tests.integration.harness_stack import (
    CORE,
    LEGACY_PI,
    BlackHole,
    Gateway,
    Stack,
    assert_one_exact_chain,
    cache_dir,
    closed_port_url,
    harness_marks,
    harness_task,
    preinstall,
)

pytestmark = harness_marks()

MATRIX = {
    "qwen-anthropic": ("qwen_code", {"protocol": "anthropic"}, "anthropic_messages"),
    "qwen-responses": ("qwen_code", {"protocol": "openai-responses"}, "openai_responses"),
    "pi-responses": ("pi", {"protocol": "openai-responses"}, "openai_responses"),
    "pi-anthropic": ("pi", {"protocol": "anthropic-messages"}, "anthropic_messages"),
    "pi-google": ("pi", {"protocol": "google-generative-ai"}, "gemini"),
}
FULL_MATRIX = os.environ.get("POLAR_HARNESS_MATRIX") == "full"
VARIANTS = {**CORE, **(MATRIX if FULL_MATRIX else {})}


@pytest.fixture(scope="module")
async def batch(tmp_path_factory):
    """Install (or find) the CLIs, start the stack, run every task at once."""
    installs = await preinstall(cache_dir())
    root = tmp_path_factory.mktemp("harness-stack")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POLAR_HARNESS_CACHE", str(cache_dir()))  # the node's shared CLI cache
        stack = Stack.up(root)
    no_stream = await Gateway(stack.proxy_url, "no_stream").start()
    strip = await Gateway(stack.proxy_url, "strip_events").start()
    hole = await BlackHole().start()
    tasks = [harness_task(tid, h, **dict(agent)) for tid, (h, agent, _) in VARIANTS.items()]
    fallback = next(t for t in tasks if t["task_id"] == "claude-fallback")
    fallback["agent"]["settings"] = {"proxy_url": no_stream.url}
    fallback["runtime"]["network"] = "host"  # the gateway is a port of the node
    tasks += [
        harness_task("fail-crash", "codex", args=["--no-such-flag"]),
        harness_task("fail-hang", "pi", settings={"proxy_url": hole.url}, agent_timeout=20),
        harness_task("fail-unreachable", "pi", settings={"proxy_url": closed_port_url()}),
        harness_task(
            "fail-silent",
            "pi",
            version=LEGACY_PI,
            protocol="anthropic-messages",
            settings={"proxy_url": strip.url},
        ),
        # queued behind the failures: the stack must still serve it
        harness_task("after-failures", "pi", protocol="openai-completions"),
    ]
    try:
        runs = await stack.run(tasks)
        yield {"runs": runs, "installs": installs, "no_stream": no_stream, "hole": hole}
    finally:
        for server in (no_stream, strip, hole):
            await server.stop()
        stack.down()


@pytest.mark.parametrize("task_id", list(VARIANTS))
async def test_variant_writes_the_file_and_builds_one_exact_chain(batch, task_id):
    run = batch["runs"][task_id]
    harness, _, protocol = VARIANTS[task_id]
    assert_one_exact_chain(run, harness, protocol)


async def test_opencode_title_call_is_tagged_and_kept_apart(batch):
    run = batch["runs"]["opencode"]
    titles = [r for r in run.records if r.side_call == "title"]
    assert len(titles) == 1 and not _json(titles[0].raw_request).get("tools")
    assert [t["side_call"] for t in run.side_traces] == ["title"]


async def test_gemini_router_call_is_tagged_and_kept_apart(batch):
    run = batch["runs"]["gemini-router"]
    routers = [r for r in run.records if r.side_call == "router"]
    # it scores the task, then works; on a loaded machine it was seen to route again (three
    # router calls in one run), each tagged and kept out of the main chain
    assert routers and routers[0].seq == 0
    assert all("responseJsonSchema" in _json(r.raw_request)["generationConfig"] for r in routers)
    assert run.side_traces and {t["side_call"] for t in run.side_traces} == {"router"}
    assert not [r for r in batch["runs"]["gemini"].records if r.side_call]  # -m: no router


async def test_claude_streams_and_falls_back_to_non_streaming(batch):
    streamed = batch["runs"]["claude-stream"].records
    assert all(_json(r.raw_request).get("stream") is True for r in streamed)
    fallback = batch["runs"]["claude-fallback"].records
    assert fallback and all(_json(r.raw_request).get("stream") is False for r in fallback)
    # each of its turns first tried a stream, got no events, and asked again without
    asked = [streaming for _, streaming in batch["no_stream"].seen]
    assert asked.count(True) >= len(fallback) and asked.count(False) == len(fallback)
    # headless, this version makes no side call: no probe, no count_tokens (both would be
    # captured and tagged)
    assert not [r.side_call for r in streamed + fallback if r.side_call]


async def test_a_crashing_cli_ends_in_error_with_its_reason(batch):
    run = batch["runs"]["fail-crash"]
    assert run.session.state == "ERROR"
    assert "codex exited with code 2: error: unexpected argument '--no-such-flag'" in (
        run.session.reason
    )
    assert run.records == [] and run.trajectory["outcome"] == Outcome.ERROR.value


async def test_a_hanging_cli_is_killed_at_its_timeout(batch):
    run = batch["runs"]["fail-hang"]
    assert run.session.state == "TIMEOUT", run.session.reason
    assert "agent timeout after 20s" in run.session.reason
    assert batch["hole"].connections >= 1  # it did reach the endpoint, which never answered
    assert run.records == []


async def test_a_cli_that_never_reaches_the_model_ends_in_error(batch):
    run = batch["runs"]["fail-unreachable"]
    assert run.session.state == "ERROR"
    assert "pi exited with code 1" in run.session.reason
    assert run.records == []


async def test_pi_exiting_0_after_a_failed_call_is_an_error(batch):
    run = batch["runs"]["fail-silent"]
    assert run.finished.artifacts.exit_code == 0  # what pi 0.x reports ...
    assert run.session.state == "ERROR"  # ... is not what happened
    assert "pi exited 0 without an answer" in run.session.reason
    assert run.records  # it called the model; the gateway broke the stream
    assert run.trajectory["harness_version"] == LEGACY_PI


FAILURES = ("fail-crash", "fail-hang", "fail-unreachable", "fail-silent")


async def test_the_stack_moves_on_after_failing_clis(batch):
    runs = batch["runs"]
    after = runs["after-failures"]
    assert after.session.state == "COMPLETED" and after.session.reward == 1.0, after.session.reason
    assert all(runs[f].session.state in ("ERROR", "TIMEOUT") for f in FAILURES)
    # the failures' slots came back: every session got one (3 at a time, 13 or 18 sessions)
    assert all("RUNNING" in run.entered for run in runs.values())


def test_report(batch):
    """Per variant: install at INIT (the cache is warm), INIT, harness-run and whole-session
    seconds (first state to last), model calls (main + side), and per call the proxy's
    whole time with the engine's part."""
    head = "variant            install  init_s  run_s  wall_s  calls  proxy_ms/call (engine_ms)"
    lines = ["", head]
    for task_id, run in batch["runs"].items():
        install = json.loads(run.finished.artifacts.logs.get("logs/harness.json", "{}"))
        calls = ", ".join(f"{whole:.0f}({engine:.0f})" for whole, engine in run.proxy_ms())
        main = sum(1 for r in run.records if r.side_call is None)
        lines.append(
            f"{task_id:18} {install.get('install_seconds', '-'):>6}s"
            f" {run.stage_seconds('INITIALIZING', 'READY')!s:>7}"
            f" {run.stage_seconds('RUNNING', 'POSTRUN')!s:>6}"
            f" {round(max(run.entered.values()) - min(run.entered.values()), 1):>7}"
            f"  {main}+{len(run.records) - main}    {calls}"
        )
    for spec, got in batch["installs"].items():
        lines.append(f"install {spec}: {got.seconds:.1f}s ({'cached' if got.cached else 'cold'})")
    print("\n".join(lines), file=sys.stderr)
    assert all(run.stage_seconds("RUNNING", "POSTRUN") for run in batch["runs"].values())


def _json(raw) -> dict:
    return orjson.loads(bytes(raw))
