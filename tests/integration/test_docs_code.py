"""Every code block of the tutorials and how-to guides, run as a reader runs it.

The pages run in reading order (``PAGES``), in one working directory, each page in a
bash of its own, against ONE stack: the first tutorial's own ``polar up`` starts it
and this module stops it after the last page. A page's files are written where the
reader writes them (```` ```yaml title="task.yaml" ````), its ``bash`` and ``python``
blocks run in order, ``<!-- expect: REGEX -->`` checks a block's output and
``<!-- skip: reason -->`` leaves a block out (a GPU, a cluster, a five-minute run).
The convention: tests/helpers/doc_blocks.py. Running one page runs the pages before it
first (a tutorial builds on the ones before it).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers.doc_blocks import BlockFailed, PageShell, parse_file, write_file

ROOT = Path(__file__).resolve().parents[2]
# Reading order: a page may use what the pages before it wrote and started.
PAGES = (
    "docs/tutorials/first-task.md",
    "docs/tutorials/cli-harness.md",
    "docs/tutorials/train.md",
    "docs/tutorials/trl.md",
    "docs/tutorials/real-engine.md",
    "docs/how-to/submit-from-code.md",
    "docs/how-to/write-an-evaluator.md",
    "docs/how-to/add-a-harness-preset.md",
    "docs/how-to/add-a-model-family.md",
    "docs/how-to/read-a-trajectory.md",
    "docs/how-to/debug-a-failed-session.md",
    "docs/how-to/export-for-sft.md",
    "docs/how-to/secure-a-deployment.md",
    "docs/how-to/kubernetes-and-slurm.md",
)
BLOCK_TIMEOUT = 240.0  # seconds: `polar train` on a loaded machine


def reader_env() -> dict[str, str]:
    """The reader's shell: this venv's `polar` and `python` first on PATH, none of the
    test process's own stack variables (the port range kept: this worker's ports), no
    `nats` CLI context written (it would replace the developer's own)."""
    keep = {"POLAR_PORT_RANGE"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLAR_") or k in keep}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    env.update({"POLAR_NATS_CONTEXT": "", "COLUMNS": "200", "NO_PROXY": "127.0.0.1,localhost"})
    return env


class Site:
    """The pages run so far, in one directory, with what each one did."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.failed: dict[str, str] = {}
        self.done: dict[str, Counter] = {}
        self.seconds: dict[str, float] = {}

    def run_through(self, page: str) -> Counter:
        for earlier in PAGES[: PAGES.index(page)]:
            if earlier not in self.done and earlier not in self.failed:
                self._run(earlier)
            if earlier in self.failed:
                pytest.fail(f"{earlier}, which this page builds on, failed first")
        if page not in self.done and page not in self.failed:
            self._run(page)
        if page in self.failed:
            pytest.fail(self.failed[page], pytrace=False)
        return self.done[page]

    def _run(self, page: str) -> None:
        t0, counts = time.monotonic(), Counter()
        shell = PageShell(self.work, reader_env(), sys.executable)
        try:
            for block in parse_file(ROOT / page, ROOT):
                counts[block.action] += 1
                if block.action == "file":
                    write_file(block, self.work)
                elif block.action == "run":
                    shell.run(block, f"{page}:{block.line}", BLOCK_TIMEOUT)
        except BlockFailed as err:
            self.failed[page] = str(err)
        finally:
            shell.close()
            self.seconds[page] = time.monotonic() - t0
        if page not in self.failed:
            self.done[page] = counts

    def stop(self) -> None:
        """The stack the first tutorial started (what its skipped `polar down` does)."""
        from infra import devstack

        state = self.work / ".state"
        if (state / "stack.json").exists():
            devstack.down(state)


@pytest.fixture(scope="module")
def site():
    missing = [tool for tool in ("bash", "curl", "python3") if shutil.which(tool) is None]
    if missing:  # what the pages' readers are told to use
        pytest.skip(f"the docs' code needs {', '.join(missing)} on PATH (apt-get install ...)")
    work = Path(tempfile.mkdtemp(prefix="polar-docs-"))
    s = Site(work)
    t0 = time.monotonic()
    try:
        yield s
    finally:
        s.stop()
        total = Counter()
        for counts in s.done.values():
            total.update(counts)
        print(
            f"\ndocs code: {len(s.done)} pages, {total['run']} blocks run, "
            f"{total['file']} files written, {total['skip']} skipped; "
            f"{time.monotonic() - t0:.0f}s in all ("
            + ", ".join(f"{Path(p).stem} {sec:.0f}s" for p, sec in s.seconds.items())
            + (f"); work dir kept: {work}" if s.failed else ")")
        )
        if not s.failed:  # a failed page's files and stack logs stay for a look
            shutil.rmtree(work, ignore_errors=True)


def test_every_tutorial_and_how_to_page_is_run():
    pages = sorted(
        str(p.relative_to(ROOT))
        for sub in ("tutorials", "how-to")
        for p in (ROOT / "docs" / sub).glob("*.md")
        if p.name != "index.md"
    )
    assert sorted(PAGES) == pages, "add the page to PAGES, in reading order"


@pytest.mark.parametrize("page", PAGES)
def test_page_code_runs(site, page):
    counts = site.run_through(page)
    assert counts["run"] + counts["file"] + counts["skip"] > 0, f"{page} has no code"
