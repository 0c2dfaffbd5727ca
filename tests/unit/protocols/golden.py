"""Golden cases: tests/fixtures/protocols/<protocol>/<case>/.

Inputs: request.json (what the harness sent), turn.json (the model's answer), route.json
(optional path params and query). Expected: conversation.json, response.json, stream.sse.
Run with POLAR_REGEN_GOLDEN=1 to rewrite the expected files (then review the diff).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import orjson

from proxy.conversation import AssistantTurn, Conversation
from proxy.protocols import PROTOCOLS, ProtocolSpec, ReplyIds

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "protocols"
IDS = ReplyIds("0a1b2c3d", 1764400000)
REGEN = os.environ.get("POLAR_REGEN_GOLDEN") == "1"
SPECS = {p.name: p for p in PROTOCOLS}


@dataclass(frozen=True)
class Case:
    dir: Path

    @property
    def spec(self) -> ProtocolSpec:
        return SPECS[self.dir.parent.name]

    def load(self, name: str) -> Any:
        return orjson.loads((self.dir / name).read_bytes())

    @property
    def request(self) -> dict[str, Any]:
        return self.load("request.json")

    @property
    def route(self) -> dict[str, Any]:
        path = self.dir / "route.json"
        return self.load("route.json") if path.exists() else {}

    @property
    def turn(self) -> AssistantTurn:
        return msgspec.convert(self.load("turn.json"), AssistantTurn)

    def parse(self) -> Conversation:
        route = self.route
        assert self.spec.parse_request is not None
        return self.spec.parse_request(
            self.request, route.get("path_params", {}), route.get("query", {})
        )

    def expect_json(self, name: str, actual: Any) -> Any:
        path = self.dir / name
        if REGEN or not path.exists():
            path.write_bytes(orjson.dumps(actual, option=orjson.OPT_INDENT_2) + b"\n")
        return self.load(name)

    def expect_bytes(self, name: str, actual: bytes) -> bytes:
        path = self.dir / name
        if REGEN or not path.exists():
            path.write_bytes(actual)
        return path.read_bytes()

    def __str__(self) -> str:
        return f"{self.dir.parent.name}/{self.dir.name}"


def cases() -> list[Case]:
    return [Case(d) for d in sorted(FIXTURES.glob("*/*")) if (d / "request.json").exists()]
