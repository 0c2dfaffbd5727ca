"""The code blocks of a docs page, and running them as a reader would.

The convention, for whoever writes a page of docs/tutorials/ or docs/how-to/ (both are
run by tests/integration/test_docs_code.py, in reading order, against one stack):

- a block with a title, ```` ```yaml title="task.yaml" ````, is a file: written at that
  path (relative to the page's working directory) when the reader reaches it;
- ```` ```bash ```` (or ``sh``, ``shell``) runs, in order, in one shell per page (a
  ``cd`` or an ``export`` carries to the page's later blocks); ```` ```python ```` without
  a title runs with the same Python;
- ```` ```text ````, ``console``, ``output`` and ``mermaid`` blocks are what a reader
  sees (output, diagrams): never run;
- ``<!-- skip: reason -->`` on the line above a block: not run (a GPU, a cluster, a
  five-minute demo), the reason required;
- ``<!-- expect: REGEX -->`` on the line above a run block: its output must match.

Any other block (a ``yaml`` or ``json`` without a title, say) is an error: every block of
a page either runs, is written, is shown output, or says why it is skipped.
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

RUN_LANGS = frozenset({"bash", "sh", "shell", "python"})
SHOWN_LANGS = frozenset({"text", "console", "output", "mermaid"})
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
DIRECTIVE = re.compile(r"^\s*<!--\s*(?P<kind>skip|expect):\s*(?P<value>.*?)\s*-->\s*$")
TITLE = re.compile(r"""title=(?:"(?P<dq>[^"]*)"|'(?P<sq>[^']*)'|(?P<bare>\S+))""")

Action = Literal["file", "run", "show", "skip"]


class DocBlockError(ValueError):
    """A page's block breaks the convention (the message names the page and line)."""


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    lang: str  # the info string's first word ("" for none)
    code: str
    title: str | None = None
    skip: str | None = None
    expect: str | None = None

    @property
    def action(self) -> Action:
        if self.skip is not None:
            return "skip"
        if self.title:
            return "file"
        if self.lang in RUN_LANGS:
            return "run"
        return "show"


def _directives(lines: list[str], fence_index: int) -> dict[str, str]:
    """The ``<!-- skip: … -->`` / ``<!-- expect: … -->`` comments right above a fence
    (blank lines between them allowed, any other text ends the search)."""
    found: dict[str, str] = {}
    i = fence_index - 1
    while i >= 0:
        text = lines[i]
        m = DIRECTIVE.match(text)
        if m:
            found.setdefault(m["kind"], m["value"])
        elif text.strip():
            break
        i -= 1
    return found


def _dedent(body: list[str], indent: str) -> str:
    out = [line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in body]
    return "\n".join(out) + ("\n" if out else "")


def parse(text: str, where: str = "page") -> list[Block]:
    """Every fenced block of ``text``, in order; a ``DocBlockError`` for a block that
    breaks the convention."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m["indent"], m["fence"], m["info"].strip()
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), None)
        if end is None:
            raise DocBlockError(f"{where}:{i + 1}: a code block that is never closed")
        blocks.append(_block(lines, i, end, indent, info, where))
        i = end + 1
    return blocks


def _block(lines: list[str], start: int, end: int, indent: str, info: str, where: str) -> Block:
    lang = info.split(None, 1)[0].lstrip("{.").rstrip("}") if info else ""
    t = TITLE.search(info)
    title = (t["dq"] or t["sq"] or t["bare"]) if t else None
    d = _directives(lines, start)
    block = Block(
        line=start + 1,
        lang=lang.lower(),
        code=_dedent(lines[start + 1 : end], indent),
        title=title,
        skip=d.get("skip"),
        expect=d.get("expect"),
    )
    here = f"{where}:{block.line}"
    if block.skip is not None and not block.skip:
        raise DocBlockError(f"{here}: `<!-- skip: -->` needs a reason")
    if block.action == "show" and block.lang not in SHOWN_LANGS:
        raise DocBlockError(
            f"{here}: a ```{block.lang or '(no language)'} block neither runs nor is written: "
            'give it a title="path" (a file), make it ```text (output), or add '
            "<!-- skip: reason -->"
        )
    if block.expect is not None and block.action != "run":
        raise DocBlockError(f"{here}: `<!-- expect: -->` belongs above a block that runs")
    if block.title and (Path(block.title).is_absolute() or ".." in Path(block.title).parts):
        raise DocBlockError(f"{here}: title={block.title!r} must be a path under the page's dir")
    return block


def parse_file(path: Path, root: Path | None = None) -> list[Block]:
    where = str(path.relative_to(root)) if root else str(path)
    return parse(path.read_text(encoding="utf-8"), where)


class BlockFailed(AssertionError):
    pass


class PageShell:
    """One bash per page, in ``cwd``: each run block is sourced in turn (so ``cd`` and
    ``export`` carry over, and ``set -e`` ends the page at the first failing command),
    its output captured; a python block runs as ``python - <<'EOF'`` in that shell."""

    MARK = "__polar_doc_block_done__"

    def __init__(self, cwd: Path, env: dict[str, str], python: str) -> None:
        self.cwd, self.python = cwd, python
        self.proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._send("set -eo pipefail")
        self.count = 0

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def run(self, block: Block, where: str, timeout: float) -> str:
        """Run ``block``; its output. ``BlockFailed`` when it fails, times out or its
        output does not match its ``expect``."""
        self.count += 1
        script = self.cwd / f".doc-block-{self.count}.sh"
        body = block.code
        if block.lang == "python":
            body = f"{self.python} - <<'__POLAR_PY__'\n{block.code}__POLAR_PY__\n"
        script.write_text(body)
        self._send(f"source {script} </dev/null; echo; echo {self.MARK} $?")
        out, deadline = [], time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                self.close()
                raise BlockFailed(
                    f"{where}: timed out after {timeout:.0f}s\n{''.join(out)}"
                ) from None
            if line is None:
                code = self.proc.wait()
                raise BlockFailed(f"{where}: failed (exit {code})\n{''.join(out)}")
            if line.startswith(self.MARK):
                break
            out.append(line)
        script.unlink()
        text = "".join(out)
        if block.expect and not re.search(block.expect, text):
            raise BlockFailed(f"{where}: output does not match {block.expect!r}\n{text}")
        return text

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
            self.proc.wait()


def write_file(block: Block, cwd: Path) -> Path:
    assert block.title
    path = cwd / block.title
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(block.code, encoding="utf-8")
    return path
