"""`polar demo --task`: a user's own family, refused before anything starts when it cannot
be run as asked (issue 38.5). The runs themselves: tests/integration/test_learning_demo.py."""

from pathlib import Path

from typer.testing import CliRunner

from services.cli import main

QUIZ = Path(__file__).resolve().parents[3] / "examples" / "own_task" / "family.py"


def invoke(*args: str):
    return CliRunner().invoke(main.app, ["demo", *args], env={"COLUMNS": "200"})


def test_a_family_file_that_is_not_there_is_an_error(tmp_path):
    r = invoke("--task", str(tmp_path / "mine.py"))
    assert r.exit_code == 1 and "no file" in r.output


def test_shaping_an_unordered_family_is_refused_with_the_reason():
    r = invoke("--task", str(QUIZ), "--reward", "shaped")
    assert r.exit_code == 1
    assert "assumes ordered numeric answers" in " ".join(r.output.split())


def test_an_unknown_reward_is_refused():
    r = invoke("--reward", "partial")
    assert r.exit_code == 1 and "reward must be one of" in r.output
