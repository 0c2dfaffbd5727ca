"""``GET /v1/models`` (and ``/v1/models/{id}``): the session's model, in a shape the OpenAI
SDKs (object, data[].id/object/created/owned_by), the Anthropic SDK (data[].type/
display_name/created_at, has_more, first_id, last_id) and Gemini's v1 clients (models[])
can all read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.errors import DEFAULT_STATUS, ErrorKind
from proxy.protocols.base import Endpoint, ProtocolSpec, Route
from proxy.protocols.gemini import model_entry as gemini_entry

NAME = "models"


def model_entry(model: str) -> dict[str, Any]:
    return {
        "id": model,
        "object": "model",
        "created": 0,
        "owned_by": "polar",
        "type": "model",
        "display_name": model,
        "created_at": "1970-01-01T00:00:00Z",
    }


def render_models(model: str, path_params: Mapping[str, Any]) -> dict[str, Any]:
    if path_params.get("model_id"):
        return {**model_entry(model), **gemini_entry(model)}
    listing = {
        "object": "list",
        "data": [model_entry(model)],
        "has_more": False,
        "first_id": model,
        "last_id": model,
    }
    return {**listing, "models": [gemini_entry(model)]}


def error_body(
    kind: ErrorKind, message: str, param: str | None, status: int | None = None
) -> tuple[int, dict[str, Any]]:
    """One body that reads as an OpenAI, an Anthropic and a Gemini error at once."""
    status = status or DEFAULT_STATUS[kind]
    error = {
        "type": f"{kind.value}_error",
        "message": message,
        "param": param,
        "code": status,
        "status": kind.name,
    }
    return status, {"type": "error", "error": error}


PROTOCOL = ProtocolSpec(
    name=NAME,
    routes=(
        Route("GET", "/v1/models", Endpoint.MODELS),
        Route("GET", "/v1/models/{model_id:path}", Endpoint.MODEL),
    ),
    error_body=error_body,
    render_models=render_models,
)
