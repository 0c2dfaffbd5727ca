"""Every example runs, at a smoke size, as `just example-*` runs it (issue 38.15: the rubric
example had failed on main unnoticed). Each is its own process, starting and stopping its
own stack; the ones that build podman images skip, saying why, where no Docker engine
answers (tests/helpers/requires.py). A new `example-*` recipe in the justfile without a
smoke run here fails ``test_every_example_recipe_has_a_smoke_run``.

Measured (2 shared cores, load average 12-20 from other jobs; 266 s for the file):
calculator (shell only) 19 s, rubric 21 s, swebench 36 s, harbor 25 s, count_stars (1
step, 4 warm-start steps) 28 s, swegym toy (1 step) 60 s, trl_grpo (2 steps) 29 s,
own_task (2 steps) 44 s. Most of each is its own stack starting and stopping.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.requires import requires_docker
from tests.unit.engine.tiny import tiny_model_dir

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 600
# they build their images with the podman CLI (examples/swebench/build_image.sh), then run
# their sessions through the Docker API
PODMAN = [
    requires_docker,
    pytest.mark.skipif(
        shutil.which("podman") is None,
        reason="podman is not on PATH: the example builds its images with it "
        "(`just setup` installs it as root with apt)",
    ),
]

# `just test` runs the examples without image builds or a training loop of their own
# (~2 minutes); `just test-examples` (POLAR_EXAMPLES=all) runs every one (~4.5 minutes):
# together they kept `just test` over CI's 30 minutes.
ALL = os.environ.get("POLAR_EXAMPLES") == "all"
FULL_ONLY = [
    pytest.mark.skipif(
        not ALL, reason="`just test-examples` runs it (POLAR_EXAMPLES=all): CI's time"
    )
]

# recipe -> (argv after `python`, the marks saying what it needs)
SMOKE: dict[str, tuple[list[str], list]] = {
    "example-calculator": (["examples/calculator/run.py", "--harness", "shell"], []),
    "example-rubric": (["-m", "examples.rubric.run"], []),
    "example-count-stars": (
        ["-m", "examples.count_stars.run", "--steps", "1", "--warm-steps", "4"],
        FULL_ONLY,
    ),
    # these two are what the TRL and own-task tutorials do, which `just test` runs
    # (tests/integration/test_docs_code.py): here in `just test-examples` only
    "example-trl-grpo": (
        ["-m", "examples.trl_grpo.run", "--steps", "2", "--model-dir", ""],
        FULL_ONLY,
    ),
    "example-own-task": (
        ["-m", "examples.own_task.run", "--steps", "2", "--model-dir", ""],
        FULL_ONLY,
    ),
    "example-swebench": (["-m", "examples.swebench.run"], PODMAN + FULL_ONLY),
    "example-harbor": (["-m", "examples.harbor.run"], PODMAN + FULL_ONLY),
    "example-swegym-toy": (["-m", "examples.swegym_grpo.run", "--steps", "1"], PODMAN + FULL_ONLY),
}


def recipes() -> list[str]:
    return re.findall(r"^(example-[\w-]+)", (REPO / "justfile").read_text(), re.M)


def test_every_example_recipe_has_a_smoke_run():
    assert sorted(recipes()) == sorted(SMOKE)


def argv(recipe: str) -> list[str]:
    args = list(SMOKE[recipe][0])
    if "--model-dir" in args:  # the tests' cached tiny model (read only), not a new one
        args[args.index("--model-dir") + 1] = str(tiny_model_dir())
    return args


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize(
    "recipe", [pytest.param(r, marks=marks) for r, (_, marks) in SMOKE.items()]
)
def test_example_runs(recipe, tmp_path):
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    env.pop("POLAR_EXAMPLE_KEEP", None)
    env.pop("POLAR_ENV_FILE", None)  # each example finds the stack it starts itself
    log = tmp_path / f"{recipe}.log"
    with log.open("wb") as out:
        done = subprocess.run(
            [sys.executable, *argv(recipe)],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=TIMEOUT,
        )
    tail = log.read_text(errors="replace")[-4000:]
    assert done.returncode == 0, f"{recipe} exited {done.returncode}:\n{tail}"
