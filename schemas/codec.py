"""Encoding and decoding of the contract.

Events between services (``decode``): JSON, unknown fields tolerated. A task a person
submits, on the bus or over HTTP (``decode_strict``): unknown fields are rejected,
naming every path. Every failure is a
``ContractError`` whose message names the field (``$.agent.harness``) and the problem.
"""

from __future__ import annotations

import functools
import re
from typing import Any, TypeVar

import msgspec

from schemas.events import Event

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder] = {}
_PATH = re.compile(r" - at `(\$[^`]*)`$")


class ContractError(ValueError):
    """A message that does not fit the contract. ``field`` is a JSON path or None."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    @property
    def reason(self) -> str:
        return str(self)


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def _decoder(tp: Any) -> msgspec.json.Decoder:
    dec = _decoders.get(tp)
    if dec is None:
        dec = _decoders[tp] = msgspec.json.Decoder(tp)
    return dec


def _contract_error(exc: msgspec.MsgspecError) -> ContractError:
    msg = str(exc)
    m = _PATH.search(msg)
    return ContractError(msg, m.group(1) if m else None)


def decode(data: bytes | str, tp: type[T]) -> T:
    try:
        return _decoder(tp).decode(data)
    except msgspec.DecodeError as exc:  # includes ValidationError
        raise _contract_error(exc) from None


def decode_event(data: bytes | str) -> Event:
    return decode(data, Event)  # type: ignore[arg-type]


def unknown_fields(tp: Any, obj: Any, path: str = "$") -> list[str]:
    """JSON paths of keys in ``obj`` that ``tp`` does not declare (recursively)."""
    return _unknown(_type_info(tp), obj, path)


@functools.lru_cache(maxsize=64)
def _type_info(tp: Any) -> msgspec.inspect.Type:
    """``msgspec.inspect.type_info``, once per type: it resolves every annotation of the
    type's tree each call (a tenth of the scheduler's CPU, once per submitted task)."""
    return msgspec.inspect.type_info(tp)


def _unknown(info: msgspec.inspect.Type, obj: Any, path: str) -> list[str]:
    if isinstance(info, msgspec.inspect.StructType) and isinstance(obj, dict):
        known = {f.encode_name: f for f in info.fields}
        out = []
        for key, value in obj.items():
            if key == info.tag_field:
                continue
            f = known.get(key)
            if f is None:
                out.append(f"{path}.{key}")
            else:
                out.extend(_unknown(f.type, value, f"{path}.{key}"))
        return out
    if isinstance(info, msgspec.inspect.UnionType):
        structs = [t for t in info.types if isinstance(t, msgspec.inspect.StructType)]
        if isinstance(obj, dict) and structs:
            tag_field = structs[0].tag_field
            match = [s for s in structs if tag_field and s.tag == obj.get(tag_field)] or structs[:1]
            return _unknown(match[0], obj, path)
        for t in info.types:
            if isinstance(t, msgspec.inspect.ListType | msgspec.inspect.DictType):
                return _unknown(t, obj, path)
        return []
    if isinstance(info, msgspec.inspect.ListType) and isinstance(obj, list):
        return [
            p for i, item in enumerate(obj) for p in _unknown(info.item_type, item, f"{path}[{i}]")
        ]
    if isinstance(info, msgspec.inspect.Metadata):
        return _unknown(info.type, obj, path)
    return []


def decode_strict(data: bytes | str, tp: type[T]) -> T:
    """Decode public input: like ``decode`` but unknown fields are an error."""
    value = decode(data, tp)
    extra = unknown_fields(tp, msgspec.json.decode(data))
    if extra:
        named = ", ".join(f"`{p}`" for p in extra)
        raise ContractError(f"Unknown field{'s' if len(extra) > 1 else ''} {named}", extra[0])
    return value
