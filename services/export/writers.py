"""Writing export rows: JSONL (one JSON object a line) or Parquet (pyarrow, optional).

Parquet columns are typed per layout; nested, free-form values (``messages``,
``metadata``) are stored as JSON text so every file has one stable schema.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import orjson

PARQUET_HINT = "Parquet needs pyarrow: pip install 'polar-rollout[export]'"
JSON_COLUMNS = frozenset({"messages", "tools", "metadata", "images"})
BATCH_ROWS = 1024


class ExportError(RuntimeError):
    pass


def _pyarrow() -> Any:
    try:
        return importlib.import_module("pyarrow"), importlib.import_module("pyarrow.parquet")
    except ImportError:
        raise ExportError(PARQUET_HINT) from None


def parquet_schema(layout: str) -> Any:
    pa, _ = _pyarrow()
    ints, mask = pa.list_(pa.int64()), pa.list_(pa.int8())
    if layout == "sft":
        fields = [
            ("session_id", pa.string()), ("task_id", pa.string()), ("attempt", pa.int64()),
            ("trace_id", pa.string()), ("reward", pa.float64()), ("messages", pa.string()),
            ("tools", pa.string()), ("tokens", ints), ("loss_mask", mask),
            ("prompt_length", pa.int64()), ("images", pa.string()),  # null: no images
        ]  # fmt: skip
    elif layout == "slime":
        fields = [
            ("rollout_id", pa.string()), ("group_id", pa.string()),
            ("group_index", pa.int64()), ("index", pa.int64()), ("sample_index", pa.int64()),
            ("trace_index", pa.int64()), ("tokens", ints), ("response_length", pa.int64()),
            ("loss_mask", mask),
            ("rollout_log_probs", pa.list_(pa.float64())), ("reward", pa.float64()),
            ("status", pa.string()), ("weight_versions", pa.list_(pa.string())),
            ("session_id", pa.string()), ("metadata", pa.string()),
        ]  # fmt: skip
    else:
        raise ExportError(f"unknown layout {layout!r}")
    return pa.schema(fields)


class JsonlWriter:
    def __init__(self, path: Path, layout: str) -> None:
        self.file = open(path, "wb")  # noqa: SIM115 - closed in close()

    def write(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self.file.write(orjson.dumps(row) + b"\n")

    def close(self) -> None:
        self.file.close()


class ParquetWriter:
    def __init__(self, path: Path, layout: str) -> None:
        pa, pq = _pyarrow()
        self.pa, self.schema = pa, parquet_schema(layout)
        self.writer = pq.ParquetWriter(str(path), self.schema)
        self.pending: list[dict[str, Any]] = []

    def write(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self.pending.append(
                {k: orjson.dumps(v).decode() if k in JSON_COLUMNS else v for k, v in row.items()}
            )
        if len(self.pending) >= BATCH_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            self.writer.write_table(self.pa.Table.from_pylist(self.pending, schema=self.schema))
            self.pending = []

    def close(self) -> None:
        self._flush()
        self.writer.close()


WRITERS = {"jsonl": JsonlWriter, "parquet": ParquetWriter}
