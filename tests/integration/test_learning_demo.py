"""The learning demo, shortened: the whole stack with the trainer as its own process, a
few steps on the stars tasks. Held-out accuracy is measured through the stack, every
trace carries its own reward, and the engine's weight version follows the steps."""

import json
import re

import orjson
import pytest
from rich.console import Console

from services.demo import stars
from services.demo.run import Recipe, run
from services.demo.view import read_records

pytestmark = pytest.mark.timeout(240)

SHORT = Recipe(
    seed=1,
    budget_seconds=300.0,
    max_steps=4,
    questions=8,
    group_size=4,
    rollout_ahead=1,
    max_run=8,
    eval_every=2,
    sft_steps=10,
    sft_batch=16,
)


def test_short_learning_run_through_the_stack(tmp_path):
    console = Console(record=True, width=120)
    assert run(console, SHORT, tmp_path) == 0

    records = read_records(tmp_path / "checkpoints" / "log.jsonl")
    steps = [r for r in records if r["type"] == "step"]
    evals = [r for r in records if r["type"] == "eval"]
    assert len(steps) == 4
    # held-out measured at the start and after the last step, on the whole set, greedily
    assert evals[0]["step"] == 0 and evals[-1]["step"] == steps[-1]["step"]
    assert all(e["members"] == e["tasks"] == 3 and e["errored"] == 0 for e in evals)
    # each evaluation ran on exactly the weights of its step: the version advanced
    assert [e["versions"] for e in evals] == [[str(e["step"])] for e in evals]
    assert [s["engine_version"] for s in steps] == [str(s["step"]) for s in steps]
    assert all(s["samples"] == SHORT.questions * SHORT.group_size for s in steps)
    assert all(s["counts"]["errored"] == 0 and s["counts"]["missing"] == 0 for s in steps)

    trajectories = [orjson.loads(line) for line in (tmp_path / "trajectories.jsonl").open("rb")]
    train = [t for t in trajectories if t["task_id"].startswith("demo1-t")]
    assert train
    for t in train:
        assert t["eval_status"] == "ok" and len(t["traces"]) == SHORT.questions
        rewards = [tr["reward"] for tr in t["traces"]]
        # one reward per trace, its own answer's: exact 1, else the recipe's partial credit
        # (weight 0.5 over a window of 3): 1/2 for the right count written otherwise
        # ("03"), 1/3 or 1/6 for a near miss, else 0
        allowed = (0, 1 / 6, 1 / 3, 1 / 2, 1)
        assert all(any(r == pytest.approx(v) for v in allowed) for r in rewards), rewards
        assert t["reward"] == pytest.approx(sum(rewards) / len(rewards))
        asked = [[m for m in tr["messages"] if m["role"] == "user"][-1] for tr in t["traces"]]
        assert len({m["content"] for m in asked}) == SHORT.questions  # each asked once
        assert all(stars.line_of(m["content"]) for m in asked)
        correct = sum(1 for r in rewards if r == 1.0)
        assert re.match(rf"{correct}/{SHORT.questions} answers correct", t["eval_reason"])

    text = console.export_text()
    assert "final held-out accuracy: " in text.splitlines()[-1]
    assert (tmp_path / "checkpoints" / "curves.png").stat().st_size > 10_000
    # the best held-out step's weights are kept (past keep_checkpoints=2) and named
    top = max(evals, key=lambda e: e["accuracy"])
    best = tmp_path / "checkpoints" / f"step-{top['step']:06d}"
    assert (tmp_path / "checkpoints" / "BEST").read_text() == best.name
    assert (best / "config.json").exists()
    said = f"best checkpoint: {best} (held-out {top['accuracy']:.3f} at step {top['step']})"
    assert "".join(said.split()) in "".join(text.split())  # however the console wrapped it
    latest = (tmp_path / "checkpoints" / "LATEST").read_text().strip()
    assert json.loads((tmp_path / "checkpoints" / latest / "config.json").read_text())
