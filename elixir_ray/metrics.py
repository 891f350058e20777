"""Per-step metrics as a pyarrow Table, written to Parquet atomically."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from elixir_ray import storage

SCHEMA = pa.schema([
    ("step", pa.int64()), ("loss", pa.float64()), ("lr", pa.float64()), ("grad_norm", pa.float64()),
    ("tokens", pa.int64()), ("step_seconds", pa.float64()), ("tokens_per_s", pa.float64()),
    ("samples_consumed", pa.int64()),
    ("eval_loss", pa.float64()),  # null at steps without an evaluation (eval.every_steps)
])


def metrics_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist([{k: r.get(k) for k in SCHEMA.names} for r in rows], schema=SCHEMA)


def write_metrics(table: pa.Table, uri: str) -> None:
    fs, path = storage.resolve(uri)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    storage.write_bytes_atomic(fs, path, sink.getvalue().to_pybytes())


def read_metrics(uri: str) -> list[dict]:
    """A metrics file's rows ([] where there is none yet)."""
    fs, path = storage.resolve(uri)
    if not storage.exists(fs, path):
        return []
    with fs.open_input_file(path) as f:
        return pq.read_table(f).to_pylist()
