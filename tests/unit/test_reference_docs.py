"""docs/reference/ is what the code says now (issue 38, 6): every task field with its type,
default, constraints and comment; a harness's environment; each preset's settings."""

import ast
import re
from pathlib import Path

import pytest

from infra import docgen
from infra.docgen import harnesses, source, task
from schemas.task import TaskRequest, UploadFile
from services.node.harnesses import base, cli

ROOT = Path(__file__).resolve().parents[2]
HARNESSES = ROOT / "services" / "node" / "harnesses"


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return docgen.pages()


def test_the_committed_pages_are_what_the_generator_writes_now():
    assert docgen.stale() == [], "run `just docs-reference` and commit docs/reference/"


def test_a_stale_page_is_named_and_rewritten(pages, tmp_path):
    assert sorted(docgen.stale(tmp_path)) == sorted(docgen.PAGES)  # none written yet
    (tmp_path / "docs" / "reference").mkdir(parents=True)
    (tmp_path / "docs/reference/task.md").write_text("hand-written\n")
    assert sorted(docgen.write(tmp_path)) == sorted(docgen.PAGES)
    assert docgen.stale(tmp_path) == []
    assert (tmp_path / "docs/reference/task.md").read_text() == pages["docs/reference/task.md"]


@pytest.mark.parametrize("struct", task.structs(), ids=lambda t: t.cls.__name__)
def test_every_field_of_a_task_has_a_row_with_its_comment(pages, struct):
    page = pages["docs/reference/task.md"]
    for f in struct.fields:
        text = task.description(struct, f)
        assert text, f"{struct.cls.__name__}.{f.name} has no comment in schemas/task.py"
        assert f"| `{f.encode_name}` | " in page and source.cell(text) in page


def test_the_page_names_types_defaults_constraints_variants_and_checks(pages):
    page = pages["docs/reference/task.md"]
    for want in (
        "| `num_samples` | integer, ≥ 1, ≤ 4096 | `1` | sessions: a GRPO group |",
        "| `instruction` | string | **required** |",
        'Chosen by `"backend": "docker"`.',
        'Chosen by `"action": "exec"`.',
        "upload_file needs exactly one of `content` or `src`",
        "Ids are embedded in NATS subjects",  # a named type's comment, on its fields
        "### `exact_answer`",  # the evaluators' own docstrings
    ):
        assert want in page, want
    names = {t.cls.__name__ for t in task.structs()}
    assert names == {
        "TaskRequest", "LocalRuntime", "DockerRuntime", "ApptainerRuntime", "UploadFile",
        "UploadDir", "ExecAction", "Resources", "AgentSpec", "BuilderSpec", "EvaluatorSpec",
        "ReplaySpec",
    }  # fmt: skip


def test_comments_are_read_from_the_source():
    comments = source.field_comments(TaskRequest)
    assert comments["num_samples"] == "sessions: a GRPO group"
    assert comments["infra_retries"].startswith("more, for faults of the system only")
    assert source.rules(UploadFile) == ["upload_file needs exactly one of `content` or `src`"]


def test_the_harness_environment_is_the_documented_table(pages):
    ctx = harnesses.sample("noop")
    assert list(ctx.env()) == [v.name for v in base.SESSION_ENV]
    assert all(v.doc for v in base.SESSION_ENV)
    page = pages["docs/reference/harnesses.md"]
    for name in ("OPENAI_BASE_URL", "OPENAI_API_KEY", "OPENAI_MODEL", "POLAR_INSTRUCTION"):
        assert f"| `{name}` |" in page


def test_the_example_agent_reads_only_documented_variables():
    tree = ast.parse((ROOT / "infra" / "demo" / "agent.py").read_text())
    read = {
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isupper()
    }
    assert read and read <= {v.name for v in base.SESSION_ENV}


def test_every_setting_a_preset_reads_is_documented():
    read = set()
    for path in HARNESSES.glob("*.py"):
        read |= set(re.findall(r"settings\.get\(\s*\"(\w+)\"", path.read_text()))
    assert read == set(cli.SETTINGS)


def test_pi_max_tokens_is_shown_where_pi_reads_it(pages):
    page = pages["docs/reference/harnesses.md"]
    pi = page[page.index("### `pi`") :]
    assert "is merged into: `~/.pi/agent/models.json`" in pi
    assert '"maxTokens": 4096' in pi  # the example, merged as the preset merges it
