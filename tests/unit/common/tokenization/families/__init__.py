"""Tests of the model families' output parsers.

``official_turn`` renders an assistant turn with a model's official chat template (TRL
ships them verbatim, see its ``chat_templates/README.md``), so a test can parse exactly the
text the model was trained to write.
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from services.common.tokenization.families.base import ModelFamily
from services.common.tokenization.template import render_template

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
WEATHER_ASK = [{"role": "user", "content": "Weather in Tokyo?"}]


def official_turn(
    template: str,
    family: ModelFamily,
    history: list[dict[str, Any]],
    reply: dict[str, Any],
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The text the official ``template`` (a file name in TRL's ``chat_templates``) adds
    for the assistant ``reply`` after ``history``, its header and turn end included.
    Messages reach the template as ``family`` prepares them."""
    spec = find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("trl (the official chat templates) is not installed")
    source = (Path(spec.submodule_search_locations[0]) / "chat_templates" / template).read_text()

    def render(messages: list[dict[str, Any]]) -> str:
        prepared = family.prepare(messages)
        return render_template(source, prepared, tools, add_generation_prompt=False)

    before, after = render(history), render([*history, reply])
    assert after.startswith(before)
    return after[len(before) :]
