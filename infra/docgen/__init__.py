"""The reference pages written from the code: ``python -m infra.docgen`` (``just
docs-reference``) writes them, ``--check`` says which are out of date (a test runs it).

- docs/reference/task.md: every field of a task (``schemas/task.py``), the built-in
  evaluators and builders;
- docs/reference/harnesses.md: a harness's environment (``SESSION_ENV``), the CLI
  presets' settings, files, variables and command lines;
- docs/reference/cli.md: every ``polar`` command, argument and option (the typer app);
- docs/reference/topology.md: ``topology.yaml`` and every service's settings (the
  config Structs);
- docs/reference/http-api.md and openapi.json: the scheduler's OpenAPI document;
- docs/reference/subjects.md: NATS subjects, streams, consumers, Redis keys, events;
- docs/reference/metrics.md: every Prometheus metric family (the registry);
- docs/reference/trajectory.md: Trajectory, Trace, TaskResult, CompletionRecord.

Each page module also says what it leaves without a description (``UNDOCUMENTED``): a
test fails on any, so a new field, command or metric comes with its text.
"""

from __future__ import annotations

import importlib

# Lazy: ``infra.docgen.mkdocs_hooks`` and ``vendor`` (the site's build) import this
# package without the page modules, which import every service.
_REGISTRY = ("PAGES", "UNDOCUMENTED", "HEADER", "ROOT", "pages", "stale", "write", "portable")


def __getattr__(name: str):
    if name in _REGISTRY:
        return getattr(importlib.import_module("infra.docgen.registry"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
