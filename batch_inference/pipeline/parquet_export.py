"""Export a finished run as Parquet: every input record once, in the input's order, its input
columns exactly as they went in, plus what became of it.

The input's columns are the input's own (for a Parquet input, restored to the Arrow schema
recorded at sharding, ``RunLayout.INPUT_SCHEMA``; for a JSONL input, the types pyarrow infers
over the sharded records), with their values as they went in: an input field named as one
the run writes (``status``, ``usage``, ``round``...) was kept aside at sharding
(``rows.from_input``) and is written back. An ``id`` column is added when the input had none
(the ids sharding assigned; with ``id_field`` the input's own id column is the id). What the
run made of a record is one struct column, ``run`` (``run_`` when the input has a ``run``
column), so the run's fields never collide with the input's:

- ``status``: ``approved``, ``exhausted`` (rejected in every round), ``max_attempts``
  (in-place retry gave up), ``failed`` (the record's own permanent error, or a quarantined shard);
- ``result``: the approved text, else null; for an embedding run (``infer.task: embed``) the
  approved vector as ``fixed_size_list<float32>[N]`` (``list<float32>`` when records asked for
  different ``dimensions``), which ``numpy.stack(column.to_numpy(zero_copy_only=False))`` or
  ``column.flatten().to_numpy().reshape(-1, N)`` loads as a matrix;
- ``error``: why a record was not approved (null when it was);
- ``attempts``: the attempts the record was given;
- ``finish_reason``, ``prompt_tokens``, ``completion_tokens``: of the record's last generation
  (``length``: cut at ``max_tokens``);
- ``cached``: true when that result came from the result cache (null when not recorded).

An input line that was no record (malformed, or without its id: left out at sharding) is a
row too: every input column null, status ``failed``, ``error`` naming its ``file:line``
(``pipeline.accounting``), so the rows add up to the input's lines. A duplicate input id
is a row per occurrence (``notes`` says so).

Rows come out in the input's order (the position the shard step recorded, ``rows.input_row``),
put back through an external sort (``storage.sort``: memory bounded by one run of
``SORT_RUN_BYTES``, whatever the run's size). The count is checked against the input's lines
(the sharded records plus the malformed lines) (``ExportError`` otherwise). Blocking;
call it off the event loop.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pyarrow as pa

from batch_inference.pipeline.accounting import InputAccount, malformed_message, quarantined_lines
from batch_inference.pipeline.export import ExportError, _failure, _rows
from batch_inference.pipeline.layout import RunLayout
from batch_inference.pipeline.run import PipelineRun, StepOrderError
from batch_inference.pipeline.summaries import ShardSummary, _Summary
from batch_inference.rows import INPUT, RUN_FIELDS, Status, input_fields, input_row, input_value
from batch_inference.storage import JsonlDir
from batch_inference.storage.parquet import schema_from_text, write_rows
from batch_inference.storage.sort import ExternalSort

# What the run made of a record: one struct column beside the input's columns.
RUN_COLUMN = pa.struct([
    ("status", pa.string()), ("result", pa.string()), ("error", pa.string()), ("attempts", pa.int32()),
    ("finish_reason", pa.string()), ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()), ("cached", pa.bool_()),
])


def run_column(result: pa.DataType = pa.string()) -> pa.StructType:
    """``RUN_COLUMN`` with its ``result`` of another type (an embedding run's vectors)."""
    return pa.struct([pa.field("result", result) if f.name == "result" else f for f in RUN_COLUMN])


def vector_type(run: PipelineRun) -> pa.DataType:
    """The Arrow type of an embedding run's approved vectors: ``fixed_size_list<float32>[N]`` when
    they all have N dimensions (one pass over the results), else ``list<float32>``."""
    sizes = {len(row["result"]) for row in _rows((run.layout.results,), run.storage_options) if isinstance(row.get("result"), list)}
    return pa.list_(pa.float32(), sizes.pop()) if len(sizes) == 1 else pa.list_(pa.float32())


SORT_RUN_BYTES = 64 << 20  # rows held in memory while they are put back in input order
_NO_POSITION = (1 << 63) - 1  # a record sharded before positions were recorded: after those that have one


@dataclass(frozen=True)
class ParquetExportSummary(_Summary):
    out_url: str
    files: list[str]
    records: int
    by_status: dict[str, int]
    columns: list[str]
    run_column: str  # the struct column of the run's fields (``run``, ``run_`` when the input has a ``run``)
    wall_s: float
    malformed: int = 0  # rows for input lines that were no record (status failed, error malformed_line)
    notes: list[str] = field(default_factory=list)  # the input account's warnings (``InputAccount.notes``)


def input_schema(run: PipelineRun) -> pa.Schema:
    """The input's columns: the recorded Arrow schema of a Parquet input, else pyarrow's
    inference over the sharded records (one streaming pass, types unified across batches)."""
    recorded = run.ledger.read(RunLayout.INPUT_SCHEMA) or {}
    if recorded.get("arrow_schema"):
        return schema_from_text(recorded["arrow_schema"])
    schema: pa.Schema | None = None
    batch: list[dict[str, Any]] = []

    def unify(rows: list[dict[str, Any]]) -> None:
        nonlocal schema
        inferred = pa.Table.from_pylist(rows).schema
        try:
            schema = inferred if schema is None else pa.unify_schemas([schema, inferred], promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise ExportError(f"run {run.spec.run!r}: the input's fields have no one Arrow type across records: {exc}") from None

    for rec in JsonlDir(run.layout.sharded, storage_options=run.storage_options).iter_records_sync():
        batch.append(input_view(rec, run.spec.id_field))
        if len(batch) >= 10_000:
            unify(batch)
            batch = []
    if batch or schema is None:
        unify(batch)
    assert schema is not None
    return schema


def input_view(rec: dict[str, Any], id_field: str = "id") -> dict[str, Any]:
    """A sharded record's input fields as they went in (the run's own fields left out, the
    input's fields of the run's names put back; with an ``id_field``, ``id`` is the run's)."""
    own = RUN_FIELDS if id_field == "id" else RUN_FIELDS | {"id"}
    return {**{k: v for k, v in rec.items() if k not in own}, **input_fields(rec)}


def run_column_name(names: list[str]) -> str:
    """``run``, or ``run_`` (``run__``...) when the input has a column of that name."""
    name = "run"
    while name in names:
        name += "_"
    return name


def _attempts(row: dict[str, Any], status: str, max_rounds: int) -> int | None:
    """Attempts a record was given: the tail counts them; a round's row is its round's attempt."""
    if row.get("attempts") is not None:
        return int(row["attempts"])
    if status == Status.EXHAUSTED:
        return max_rounds
    for key in ("round", "failed_round"):
        if row.get(key) is not None:
            return int(row[key]) + 1
    return None


def _terminal_rows(run: PipelineRun) -> Iterator[tuple[dict[str, Any], str, str | None]]:
    """``(row, status, error)`` of every input line once: the run's terminal sets, the
    records of quarantined shards, then the malformed lines (a row of only ``INPUT``: its
    place in the input's order; no record was read)."""
    spec, so = run.spec, run.storage_options
    for row in _rows((run.layout.results,), so):
        yield row, Status.APPROVED.value, None
    for source in run.terminal_sources():
        if source.state in ("input", Status.APPROVED) or not source.is_dir:
            continue
        for row in _rows(source.urls, so):
            code, message = _failure(source.state, row, spec.max_rounds)
            status = code if code in (Status.EXHAUSTED, Status.MAX_ATTEMPTS) else Status.FAILED.value
            yield row, status, message
    for q in run.quarantined():
        for row in _rows((q.shard,), so, is_dir=False):
            yield row, Status.FAILED.value, f"shard_quarantined: {q.error}"
    for entry in quarantined_lines(run.layout.input_quarantine, so):
        yield {INPUT: {"follows": entry.get("follows")}}, Status.FAILED.value, malformed_message(entry)


def _order_key(row: dict[str, Any]) -> bytes:
    """Where a row goes in the input's order: its record's position; a line left out at sharding
    just after the record before it (``follows``), ahead of the next record."""
    pos = input_row(row)
    if pos is not None:
        return struct.pack(">QB", pos, 1)
    follows = (row.get(INPUT) or {}).get("follows")
    return struct.pack(">QB", follows + 1, 0) if follows is not None else struct.pack(">QB", _NO_POSITION, 1)


def _usage(row: dict[str, Any], key: str) -> int | None:
    usage = row.get("usage")
    return usage.get(key) if isinstance(usage, dict) else None


def export_parquet(run: PipelineRun, out: str | None = None, *, rows_per_file: int = 1_000_000) -> ParquetExportSummary:
    """Write ``<out>/part-NNNNN.parquet`` (default ``RunLayout.parquet_export``)."""
    t0 = time.perf_counter()
    spec, layout = run.spec, run.layout
    shard = run.ledger.read_as(layout.SHARD, ShardSummary)
    if shard is None or run.ledger.read(layout.RUN) is None:
        raise StepOrderError(f"run {spec.run!r} is not finished (ledger/run.json is missing): run it to the end first")
    columns = input_schema(run)
    own_id = spec.id_field == "id" and "id" not in columns.names  # the ids sharding assigned
    schema = columns.append(pa.field("id", pa.string())) if own_id else columns
    run_name = run_column_name(schema.names)
    schema = schema.append(pa.field(run_name, run_column(vector_type(run)) if spec.infer.task == "embed" else RUN_COLUMN))
    by_status: dict[str, int] = {}

    # a null in a non-text id column got its row's number as id at sharding: exported as the null it was
    assigned_to_null = spec.id_field == "id" and "id" in columns.names and not pa.types.is_string(columns.field("id").type) \
        and not pa.types.is_large_string(columns.field("id").type)

    def export_row(row: dict[str, Any], status: str, error: str | None) -> dict[str, Any]:
        by_status[status] = by_status.get(status, 0) + 1
        approved = status == Status.APPROVED
        out = {name: input_value(row, name) for name in columns.names}
        if assigned_to_null and isinstance(out.get("id"), str):
            out["id"] = None
        if own_id:
            out["id"] = str(row["id"]) if "id" in row else None
        out[run_name] = {"status": status, "result": row.get("result") if approved else None, "error": error,
                         "attempts": _attempts(row, status, spec.max_rounds), "finish_reason": row.get("finish_reason"),
                         "prompt_tokens": _usage(row, "prompt_tokens"), "completion_tokens": _usage(row, "completion_tokens"),
                         "cached": row.get("cached")}
        return out

    with ExternalSort(layout.export_spill, storage_options=run.storage_options, run_bytes=SORT_RUN_BYTES) as in_order:
        for row, status, error in _terminal_rows(run):
            in_order.add(_order_key(row), orjson.dumps(export_row(row, status, error)) + b"\n")
        written = write_rows(out or layout.parquet_export, schema, map(orjson.loads, in_order.sorted_lines()),
                             rows_per_file=rows_per_file, storage_options=run.storage_options)
    account = InputAccount.of_shard(shard, layout.input_quarantine)
    if written.rows != account.lines:
        raise ExportError(f"run {spec.run!r}: exported {written.rows} rows ({by_status}) but the input has "
                          f"{account.summary()}: the run's terminal sets (or {layout.input_quarantine}) do not add up")
    return ParquetExportSummary(out_url=written.url, files=written.files, records=written.rows,
                                by_status=dict(sorted(by_status.items())), columns=schema.names, run_column=run_name,
                                wall_s=time.perf_counter() - t0, malformed=account.malformed, notes=account.notes())


__all__ = ["RUN_COLUMN", "run_column", "vector_type", "ParquetExportSummary", "export_parquet", "input_schema", "input_view", "run_column_name"]
