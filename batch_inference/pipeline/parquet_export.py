"""Export a finished run as Parquet: every input record once, its input columns with their
own Arrow types, plus what became of it.

The columns are the input's (for a Parquet input, restored to the Arrow schema recorded
at sharding, ``RunLayout.INPUT_SCHEMA``; for a JSONL input, the types pyarrow infers over
the sharded records), an ``id`` column when the input had none (the ids sharding
assigned), and four of the run's own (an input column of one of these names was replaced
by the run's value while it ran; the export writes the run's and lists it in ``replaced``):

- ``status``: ``approved``, ``exhausted`` (rejected in every round), ``max_attempts``
  (in-place retry gave up), ``failed`` (the record's own permanent error, or a quarantined shard);
- ``result``: the approved text, else null;
- ``error``: why a record was not approved (null when it was);
- ``attempts``: the attempts the record was given.

An input line that was no record (malformed: left out at sharding) is a row too: every
input column null, ``status`` ``failed``, ``error`` naming its ``file:line``
(``pipeline.accounting``), so the rows add up to the input's lines. A duplicate input id
is a row per occurrence (``notes`` says so).

The count is checked against the input's lines (the sharded records plus the malformed lines) (``ExportError`` otherwise). Blocking and
streaming (one batch of rows in memory); call it off the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from batch_inference.pipeline.accounting import InputAccount, malformed_message, quarantined_lines
from batch_inference.pipeline.export import ExportError, _failure, _rows
from batch_inference.pipeline.layout import RunLayout
from batch_inference.pipeline.run import PipelineRun, StepOrderError
from batch_inference.pipeline.summaries import ShardSummary, _Summary
from batch_inference.rows import Status
from batch_inference.storage import JsonlDir
from batch_inference.storage.parquet import schema_from_text, write_rows

OWN_COLUMNS = pa.schema([("status", pa.string()), ("result", pa.string()), ("error", pa.string()), ("attempts", pa.int32())])


@dataclass(frozen=True)
class ParquetExportSummary(_Summary):
    out_url: str
    files: list[str]
    records: int
    by_status: dict[str, int]
    columns: list[str]
    replaced: list[str]  # input columns named as the export's own (status, result, error, attempts)
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
        batch.append(rec)
        if len(batch) >= 10_000:
            unify(batch)
            batch = []
    if batch or schema is None:
        unify(batch)
    assert schema is not None
    return schema


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
    records of quarantined shards, then the malformed lines (an empty row: no record was read)."""
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
        yield {}, Status.FAILED.value, malformed_message(entry)


def export_parquet(run: PipelineRun, out: str | None = None, *, rows_per_file: int = 1_000_000) -> ParquetExportSummary:
    """Write ``<out>/part-NNNNN.parquet`` (default ``RunLayout.parquet_export``)."""
    t0 = time.perf_counter()
    spec, layout = run.spec, run.layout
    shard = run.ledger.read_as(layout.SHARD, ShardSummary)
    if shard is None or run.ledger.read(layout.RUN) is None:
        raise StepOrderError(f"run {spec.run!r} is not finished (ledger/run.json is missing): run it to the end first")
    columns = input_schema(run)
    # an input column named as one of the run's own was overwritten by the run (rows.RESULT_FIELDS): the run's is written
    replaced = [name for name in OWN_COLUMNS.names if name in columns.names]
    columns = pa.schema([f for f in columns if f.name not in replaced], metadata=columns.metadata)
    schema = columns if "id" in columns.names else columns.append(pa.field("id", pa.string()))
    for f in OWN_COLUMNS:
        schema = schema.append(f)
    by_status: dict[str, int] = {}

    # a null in a non-text id column got its row's number as id at sharding: exported as the null it was
    assigned_to_null = "id" in columns.names and not pa.types.is_string(columns.field("id").type) \
        and not pa.types.is_large_string(columns.field("id").type)

    def rows() -> Iterator[dict[str, Any]]:
        for row, status, error in _terminal_rows(run):
            by_status[status] = by_status.get(status, 0) + 1
            approved = status == Status.APPROVED
            if assigned_to_null and isinstance(row.get("id"), str):
                row = {**row, "id": None}
            own_id = {} if "id" in columns.names else {"id": str(row["id"]) if "id" in row else None}
            yield {**{name: row.get(name) for name in columns.names}, **own_id,
                   "status": status, "result": row.get("result") if approved else None, "error": error,
                   "attempts": _attempts(row, status, spec.max_rounds)}

    written = write_rows(out or layout.parquet_export, schema, rows(), rows_per_file=rows_per_file,
                         storage_options=run.storage_options)
    account = InputAccount.of_shard(shard, layout.input_quarantine)
    if written.rows != account.lines:
        raise ExportError(f"run {spec.run!r}: exported {written.rows} rows ({by_status}) but the input has "
                          f"{account.summary()}: the run's terminal sets (or {layout.input_quarantine}) do not add up")
    return ParquetExportSummary(out_url=written.url, files=written.files, records=written.rows,
                                by_status=dict(sorted(by_status.items())), columns=schema.names, replaced=replaced,
                                wall_s=time.perf_counter() - t0, malformed=account.malformed, notes=account.notes())


__all__ = ["ParquetExportSummary", "export_parquet", "input_schema"]
