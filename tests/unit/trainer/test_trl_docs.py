"""docs/training.md's TRL snippet is the code examples/trl_grpo/run.py runs (tests/
integration/test_examples.py runs it through a stack), and it passes the admin token
weight pushes need (issue 38.3: without it, `RolloutError: weight update to step 1
refused: 401`)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def trl_snippet() -> str:
    doc = (REPO / "docs" / "training.md").read_text()
    section = doc[doc.index("### TRL (") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def code_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def test_the_trl_snippet_is_the_examples_code():
    example = set(code_lines((REPO / "examples" / "trl_grpo" / "run.py").read_text()))
    missing = [line for line in code_lines(trl_snippet()) if line not in example]
    assert not missing, f"lines of the docs' TRL snippet the example does not run: {missing}"


def test_the_trl_snippet_pushes_weights_with_the_admin_token():
    snippet = trl_snippet()
    assert "admin_token=conn.admin_token" in snippet
    assert "WeightSync(" in snippet
