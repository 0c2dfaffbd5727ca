"""MoE expert routing as engines return it (pure): what a token request asks for, and the
rows an answer carries, in one shape whatever the engine (``schemas/routing.py``).

  SGLang (and the embedded engine)  request ``return_routed_experts: true``; answer
      ``meta_info.routed_experts``: base64 of int32 ids, C order, rows for every position
      of prompt + output but the last ([P + N - 1, layers, top_k]); the shape is not sent,
      so layers come from the row count and the model's top_k.
  vLLM (>= 0.32, ``--enable-return-routed-experts``, non-streaming)  request
      ``sampling_params.routed_experts_prompt_start = S``; answer ``choices[0].
      routed_experts``: base64 of a ``.npy`` array [P + N - 1 - S, layers, top_k], uint8 up
      to 256 experts, else uint16; rows from position S on.
"""

from __future__ import annotations

import binascii
import io

import msgspec
import pybase64

from proxy.backends.base import BackendError, ErrorKind, RoutingAsk, RoutingRows, TokenRequest

_NPY_DTYPES = {"|u1": "uint8", "<u2": "uint16", "<i4": "int32", "<i2": "int16", "<u4": "uint32"}
_KEPT_DTYPES = {"uint8", "uint16", "int32"}  # schemas.routing.DTYPES


def _bad(message: str, worker: str) -> BackendError:
    return BackendError(ErrorKind.BAD_RESPONSE, message, worker=worker)


def _b64(value: object, what: str, worker: str) -> bytes:
    if not isinstance(value, str):
        raise _bad(f"{what} is not a base64 string", worker)
    try:
        # SIMD: a 20k-token call's SGLang rows are ~40 MB of base64 (~110 ms with the
        # standard library's decoder, ~10 ms here)
        return pybase64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _bad(f"{what} is not base64: {exc}", worker) from None


def sglang_rows(value: object, ask: RoutingAsk, positions: int, worker: str = "") -> RoutingRows:
    """``meta_info.routed_experts`` for a call of ``positions`` = P + N - 1 rows, its shape
    checked from the text's length; the text is decoded later (``decoded``), off the event
    loop when it is large (a 60k-token call's is ~120 MB of base64)."""
    if not isinstance(value, str):
        raise _bad("meta_info.routed_experts is not a base64 string", worker)
    size = len(value) // 4 * 3 - value[-2:].count("=") if len(value) % 4 == 0 else -1
    per_row = ask.top_k * 4
    if positions <= 0:
        if value:
            raise _bad("meta_info.routed_experts has rows for a call with none", worker)
        return RoutingRows(data=b"", dtype="int32", layers=0, top_k=ask.top_k, start=0, rows=0)
    if size <= 0 or size % (positions * per_row):
        raise _bad(
            f"meta_info.routed_experts has {max(size, 0)} bytes of base64: not {positions} "
            f"rows of int32 x top_k {ask.top_k} x some number of layers",
            worker,
        )
    layers = size // (positions * per_row)
    return RoutingRows(
        data=b"",
        encoded=value,
        dtype="int32",
        layers=layers,
        top_k=ask.top_k,
        start=0,
        rows=positions,
    )


def decoded(rows: RoutingRows) -> RoutingRows:
    """``rows`` with ``data`` filled from the base64 text it was read as, if any."""
    if not rows.encoded:
        return rows
    data = _b64(rows.encoded, "meta_info.routed_experts", "")
    return msgspec.structs.replace(rows, data=data, encoded="")


def vllm_rows(value: object, ask: RoutingAsk, positions: int, worker: str = "") -> RoutingRows:
    """``choices[0].routed_experts`` (a base64 ``.npy``) for a call of ``positions`` rows,
    asked from ``ask.start`` on."""
    import numpy as np

    data = _b64(value, "choices[0].routed_experts", worker)
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise _bad(f"choices[0].routed_experts is not a .npy array: {exc}", worker) from None
    dtype = _NPY_DTYPES.get(array.dtype.str)
    if array.ndim != 3 or dtype is None:
        raise _bad(
            f"choices[0].routed_experts is {array.dtype.str} {array.shape}: expected "
            "[rows, layers, top_k] of unsigned ids",
            worker,
        )
    want = max(positions - ask.start, 0)
    if array.shape[0] != want:
        raise _bad(
            f"choices[0].routed_experts has {array.shape[0]} rows, {want} were due "
            f"(positions {ask.start}..{positions})",
            worker,
        )
    if dtype not in _KEPT_DTYPES:  # kept as the smallest type the schema has that holds it
        array, dtype = array.astype("<i4"), "int32"
    return RoutingRows(
        data=np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes(),
        dtype=dtype,
        layers=int(array.shape[1]),
        top_k=int(array.shape[2]),
        start=ask.start,
        rows=want,
    )


def answer_rows(req: TokenRequest, value: object, n_output: int, read, worker: str = ""):
    """An answer's routing through ``read`` (``sglang_rows`` / ``vllm_rows``): None when
    it was not asked, or the server sent none (started without the flag)."""
    if req.routing is None or value is None:
        return None
    return read(value, req.routing, len(req.input_ids) + n_output - 1, worker)
