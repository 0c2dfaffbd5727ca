"""The six CLI presets on a Qwen3.5 and a gpt-oss engine, real CLIs through the whole stack.

test_harness_presets.py runs the CLIs on the embedded engine, which speaks Polar's own
ChatML. Here the engine is a fake SGLang over each family's real vocabulary and official
chat template (tests/helpers/family_engine.py), scripted by the same policies
(tests/fixtures/policies/harness_*.yaml, read by ``PolicyScript`` as the embedded engine
reads them) and answering in the family's own format: Qwen3.5's reasoning and XML tool
calls, gpt-oss's harmony channels. So the proxy (token mode) templates each CLI's
requests with the family's template (Claude Code's late system message, tools without a
description) and reads each reply with the family's parser into the CLI's own protocol.

One stack per family, every CLI's session at once on it; each test then reads its task's
result, trajectory and captured calls, and asserts what test_harness_presets.py does
(``assert_one_exact_chain``), plus: every call that offered tools parsed cleanly with the
family's parser, and the CLIs' side calls (opencode's title, Gemini CLI's router) are
tagged and kept apart.
"""

from __future__ import annotations

import sys
import time

import orjson
import pytest

from services.engine.policy import load_policy
from tests.helpers.family_engine import POLICY_REASONING, FamilyEngine, PolicyScript
from tests.helpers.model_families import family_model_dir
from tests.integration.harness_stack import (
    CORE,
    Stack,
    assert_one_exact_chain,
    cache_dir,
    combined_policy,
    harness_marks,
    harness_task,
    preinstall,
)

pytestmark = harness_marks()

FAMILIES = ("qwen3_5", "gpt_oss")
# every CLI and protocol of the core set; the Claude fallback is about a gateway, not a model
VARIANTS = {task_id: v for task_id, v in CORE.items() if task_id != "claude-fallback"}


@pytest.fixture(scope="module", params=FAMILIES)
async def batch(request, tmp_path_factory):
    """(family, runs): the family's fake engine and a stack on it, every variant at once."""
    await preinstall(cache_dir())
    family = request.param
    root = tmp_path_factory.mktemp(f"harness-{family}")
    model_dir = family_model_dir(family)
    script = PolicyScript(load_policy(combined_policy(root / "harness_policy.yaml")))
    fake = FamilyEngine(model_dir, script=script).start()
    backend = {"name": "fake", "kind": "sglang", "url": fake.url}
    stack = None
    try:
        t0 = time.monotonic()
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("POLAR_HARNESS_CACHE", str(cache_dir()))  # the node's shared CLI cache
            stack = Stack.up(
                root, max_run=len(VARIANTS), backend=backend, proxy={"model_dir": str(model_dir)}
            )
        t1 = time.monotonic()
        tasks = [harness_task(tid, h, **dict(agent)) for tid, (h, agent, _) in VARIANTS.items()]
        runs = await stack.run(tasks)
        print(
            f"\n{family}: stack up {t1 - t0:.1f}s, {len(tasks)} sessions"
            f" {time.monotonic() - t1:.1f}s, {len(fake.served)} engine calls",
            file=sys.stderr,
        )
        yield family, runs
    finally:
        if stack is not None:
            stack.down()
        fake.stop()


@pytest.mark.parametrize("task_id", list(VARIANTS))
async def test_cli_on_the_family_writes_the_file_and_builds_one_exact_chain(batch, task_id):
    family, runs = batch
    run = runs[task_id]
    harness, _, protocol = VARIANTS[task_id]
    assert_one_exact_chain(run, harness, protocol)
    # every call that offered tools was read by the family's parser, cleanly
    offered = [r for r in run.records if _json(r.raw_request).get("tools")]
    assert offered, [r.seq for r in run.records]
    for r in offered:
        assert r.tool_parse is not None and r.tool_parse.ok, (r.seq, r.tool_parse)
        assert r.tool_parse.family == family, r.tool_parse
    main = [r for r in run.records if r.side_call is None]
    assert main[0].tool_parse.calls == 1  # the CLI's own shell tool, as scripted
    assert main[0].finish_reason == "tool_calls" and main[-1].finish_reason == "stop"
    # the family's reasoning parser took the reasoning out of what the CLI was shown
    replies = [_json(r.reply) for r in main]
    assert all(m.get("reasoning_content") == POLICY_REASONING for m in replies), replies
    assert (
        "POLAR-FINAL" in replies[-1]["content"] and POLICY_REASONING not in replies[-1]["content"]
    )


async def test_side_calls_are_tagged_and_kept_apart(batch):
    _, runs = batch
    titles = [r for r in runs["opencode"].records if r.side_call == "title"]
    assert len(titles) == 1, [(r.seq, r.side_call) for r in runs["opencode"].records]
    assert [t["side_call"] for t in runs["opencode"].side_traces] == ["title"]
    routers = [r for r in runs["gemini-router"].records if r.side_call == "router"]
    assert routers and routers[0].seq == 0
    assert {t["side_call"] for t in runs["gemini-router"].side_traces} == {"router"}


def test_report(batch):
    """Per variant: harness-run seconds, model calls (main + side, the side calls' tags),
    prompt tokens of the last main call, and the family's parse of each call."""
    family, runs = batch
    lines = ["", f"{family}: variant  run_s  calls  last_prompt  tool_parse per call"]
    for task_id, run in runs.items():
        main = [r for r in run.records if r.side_call is None]
        sides = sorted({r.side_call for r in run.records if r.side_call})
        last = main[-1].prompt_base_len + len(main[-1].prompt_ids) if main else 0
        parses = " ".join(
            "-" if r.tool_parse is None else f"{r.tool_parse.calls}{'' if r.tool_parse.ok else '!'}"
            for r in run.records
        )
        lines.append(
            f"  {task_id:15} {run.stage_seconds('RUNNING', 'POSTRUN')!s:>5}"
            f"  {len(main)}+{len(run.records) - len(main)} {','.join(sides):8} {last:>7}  {parses}"
        )
    print("\n".join(lines), file=sys.stderr)
    assert all(run.records for run in runs.values())


def _json(raw) -> dict:
    return orjson.loads(bytes(raw))
