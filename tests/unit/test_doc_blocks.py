"""The docs' code-block convention (tests/helpers/doc_blocks.py): what runs, what is
written, what is shown, what is skipped, and the mistakes it refuses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers.doc_blocks import BlockFailed, DocBlockError, PageShell, parse, write_file

PAGE = """\
# A page

```yaml title="task.yaml"
task_id: t1
```

Run it:

<!-- expect: hello t1 -->
```bash
echo hello $(grep -o 't1' task.yaml)
```

```text
hello t1
```

<!-- skip: needs a GPU -->
```bash
nvidia-smi
```

1. In a list:

    ```python
    print("indented")
    ```

```mermaid
flowchart LR
  a --> b
```
"""


def test_each_block_gets_its_action():
    blocks = parse(PAGE)
    assert [(b.lang, b.action) for b in blocks] == [
        ("yaml", "file"),
        ("bash", "run"),
        ("text", "show"),
        ("bash", "skip"),
        ("python", "run"),
        ("mermaid", "show"),
    ]
    file, run, _, skipped, py, _ = blocks
    assert file.title == "task.yaml" and file.code == "task_id: t1\n" and file.line == 3
    assert run.expect == "hello t1" and run.skip is None
    assert skipped.skip == "needs a GPU"
    assert py.code == 'print("indented")\n'  # the list's indentation removed


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("```yaml\na: 1\n```\n", "neither runs nor is written"),
        ("```\nplain\n```\n", "neither runs nor is written"),
        ("<!-- skip: -->\n```bash\nls\n```\n", "needs a reason"),
        ("<!-- expect: x -->\n```text\nx\n```\n", "belongs above a block that runs"),
        ('```yaml title="../x.yaml"\na: 1\n```\n', "must be a path under"),
        ("```bash\nls\n", "never closed"),
    ],
)
def test_mistakes_are_refused_naming_the_line(text, message):
    with pytest.raises(DocBlockError, match=message) as err:
        parse(text, "docs/x.md")
    assert str(err.value).startswith("docs/x.md:")


def test_a_directive_reaches_only_the_next_block():
    blocks = parse("<!-- skip: slow -->\n\n```bash\nsleep 99\n```\ntext\n```bash\nls\n```\n")
    assert [b.action for b in blocks] == ["skip", "run"]


def test_a_page_shell_keeps_its_state_and_stops_at_the_first_failure(tmp_path: Path):
    blocks = parse(
        '```bash title="x.sh"\necho from-file\n```\n'
        "```bash\nexport WHO=reader\nmkdir -p sub && cd sub\n```\n"
        '<!-- expect: reader in sub -->\n```bash\necho "$WHO in $(basename $PWD)"\n```\n'
        '```python\nimport os; print("py", os.getcwd().endswith("sub"))\n```\n'
        "```bash\nfalse\necho never\n```\n"
    )
    shell = PageShell(tmp_path, {"PATH": "/usr/bin:/bin"}, sys.executable)
    try:
        assert write_file(blocks[0], tmp_path).read_text() == "echo from-file\n"
        assert shell.run(blocks[1], "b1", 10).strip() == ""
        assert "reader in sub" in shell.run(blocks[2], "b2", 10)
        assert "py True" in shell.run(blocks[3], "b3", 10)
        with pytest.raises(BlockFailed, match="failed"):
            shell.run(blocks[4], "b4", 10)
    finally:
        shell.close()


def test_an_unmatched_expectation_and_a_timeout_fail(tmp_path: Path):
    blocks = parse(
        "<!-- expect: ^never$ -->\n```bash\necho something\n```\n```bash\nsleep 30\n```\n"
    )
    shell = PageShell(tmp_path, {"PATH": "/usr/bin:/bin"}, sys.executable)
    try:
        with pytest.raises(BlockFailed, match="does not match"):
            shell.run(blocks[0], "b0", 10)
        with pytest.raises(BlockFailed, match="timed out"):
            shell.run(blocks[1], "b1", 0.5)
    finally:
        shell.close()


ROOT = Path(__file__).resolve().parents[2]


def test_every_page_that_runs_follows_the_convention():
    """A mistake in a tutorial's or a how-to's blocks fails here, without a stack."""
    pages = [
        p
        for sub in ("get-started", "tutorials", "how-to")
        for p in (ROOT / "docs" / sub).glob("*.md")
    ]
    assert pages
    for page in pages:
        parse(page.read_text(), str(page.relative_to(ROOT)))


# issue 36: the pages that moved into the site's sections (spelled in two pieces, so
# this file does not name the old paths itself)
MOVED = {
    "docs/" + page: f"docs/explanation/{page}"
    for page in ("architecture.md", "security.md", "scaling.md")
}


def test_nothing_points_at_a_page_that_moved():
    import subprocess

    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    stale = [
        f"{f}: {old} is {new} now"
        for f in files
        if f.endswith((".py", ".md", ".yml", ".yaml", "justfile", ".sbatch", ".sh"))
        and (ROOT / f).is_file()
        and not f.startswith("docs/benchmarks/")  # the history quotes the paths of its day
        for old, new in MOVED.items()
        if old in (ROOT / f).read_text(errors="replace")
    ]
    assert not stale, "\n".join(stale)
