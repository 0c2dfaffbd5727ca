"""Tools reach the template with their fields in the harness's order."""

from proxy.conversation import TOOL_FIELDS, ToolSpec, field_order, openai_tool
from proxy.protocols.anthropic_messages import parse_tools as anthropic_tools
from proxy.protocols.openai_chat import parse_tools as chat_tools

SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string"}}}


def rendered_order(spec: ToolSpec) -> list[str]:
    return list(openai_tool(spec)["function"])


def test_the_usual_order_is_kept_and_costs_nothing():
    fn = {"name": "bash", "description": "run", "parameters": SCHEMA}
    (spec,) = chat_tools([{"type": "function", "function": fn}])
    assert spec.field_order == () and rendered_order(spec) == list(TOOL_FIELDS)
    assert field_order({"name": "x", "parameters": {}}) == ()  # no description: usual


def test_another_order_is_kept():
    fn = {"parameters": SCHEMA, "name": "bash", "description": "run"}
    (spec,) = chat_tools([{"type": "function", "function": fn}])
    assert rendered_order(spec) == ["parameters", "name", "description"]
    fn = {"name": "bash", "parameters": SCHEMA, "description": "run"}
    (spec,) = chat_tools([{"type": "function", "function": fn}])
    assert rendered_order(spec) == ["name", "parameters", "description"]


def test_anthropic_input_schema_takes_the_place_of_parameters():
    (spec,) = anthropic_tools([{"input_schema": SCHEMA, "name": "bash", "description": "run"}])
    assert rendered_order(spec) == ["parameters", "name", "description"]
    (spec,) = anthropic_tools([{"name": "bash", "description": "run", "input_schema": SCHEMA}])
    assert spec.field_order == ()
