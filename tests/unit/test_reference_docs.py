"""docs/reference/ is what the code says now (issue 38, 6; issue 36, 3): every task field
with its type, default, constraints and comment; a harness's environment; each preset's
settings; every CLI command and option, topology and service key, HTTP route, subject,
metric and trajectory field, each with its description."""

import ast
import json
import re
from pathlib import Path

import msgspec
import pytest

from infra import docgen
from infra.docgen import cli as cli_page
from infra.docgen import harnesses, httpapi, metrics, source, subjects, task, topology
from infra.topology import Topology
from schemas.task import TaskRequest, UploadFile
from schemas.trajectory import Trace, Trajectory
from services.common.bus import STREAMS
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


# -- the pages issue 36 added: every part has its text, and the page shows every part --
@pytest.mark.parametrize("page", sorted(docgen.UNDOCUMENTED))
def test_every_part_a_page_shows_has_a_description(page):
    missing = docgen.UNDOCUMENTED[page]()
    assert missing == [], (
        f"{page}: no description for {missing}: add a comment on the field (or the "
        "constant), a docstring, a help= text or a metric's help, then `just docs-reference`"
    )


def test_the_cli_page_has_every_command_and_option(pages):
    page = pages["docs/reference/cli.md"]
    names = [c.name for c in cli_page.commands()]
    assert {"polar up", "polar submit", "polar credentials show", "polar model serve"} <= set(names)
    for c in cli_page.commands():
        assert f"`{c.name}`" in page
        for p in cli_page.params(c.command):
            assert (p.opts[0] if p.param_type_name == "option" else p.name.upper()) in page


def test_the_topology_page_has_every_key_and_every_service(pages):
    page = pages["docs/reference/topology.md"]
    for f in msgspec.structs.fields(Topology):
        assert f"| `{f.name}` |" in page
    for name, cls in topology.configs().items():
        assert f"| `{name}` |" in page and f"### {cls.__name__}" in page
    assert "| `backpressure_queue` |" in page  # a service's own key
    assert "`services.engine.config.ServeConfig`" in page


def test_the_http_page_and_the_shipped_document_are_the_apps(pages):
    doc = httpapi.document()
    assert json.loads(pages["docs/reference/openapi.json"]) == doc
    page = pages["docs/reference/http-api.md"]
    for path, method, _ in httpapi.operations(doc):
        assert f"### `{method.upper()} {path}`" in page
    assert "[TaskRequest](task.md#taskrequest)" in page


def test_the_subjects_page_has_every_name_and_stream(pages):
    page = pages["docs/reference/subjects.md"]
    for n in subjects.names():
        assert n.symbol in page
    assert "`polar.tasks.<task_id>.result`" in page
    for cfg in STREAMS:
        assert f"| `{cfg.name}` |" in page
    assert "```mermaid\nstateDiagram-v2" in page


def test_the_metrics_page_has_every_metric_the_source_defines(pages):
    page = pages["docs/reference/metrics.md"]
    defined = metrics.defined_in_source()
    assert len(defined) > 40 and "polar_proxy_calls_total" in defined
    for name in defined:
        shown = (
            name if name.endswith("_total") or f"`{name}_total`" not in page else f"{name}_total"
        )
        assert f"| `{shown}` |" in page, name


def test_the_trajectory_page_has_every_trace_field(pages):
    page = pages["docs/reference/trajectory.md"]
    for cls in (Trajectory, Trace):
        for f in msgspec.structs.fields(cls):
            assert f"| `{f.encode_name}` |" in page
