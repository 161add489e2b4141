"""The run's input as the pipeline sees it: its format (native JSONL, OpenAI Batch or
Parquet), its first records (for detection) and a sample spread across it (for the preflight).

OpenAI Batch files are converted to native records in the one sharding pass
(``prompting.openai_batch.OpenAIBatchReader``), and so are Parquet rows
(``storage.parquet``: each row a record, each column a field; the input's Arrow schema
is recorded in the ledger for the Parquet export); every later step sees native records only.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, TypeVar

from batch_inference.pipeline.spec import PipelineSpec, SpecError
from batch_inference.pipeline.accounting import EXAMPLES, id_lines
from batch_inference.prompting.openai_batch import OpenAIBatchReader, looks_like_openai_batch, record_id
from batch_inference.storage import CorruptShardError, JsonlDir, JsonlFile, ReshardReport, UnreadableInputError, input_format, open_source
from batch_inference.storage.parquet import ParquetSource, schema_to_text
from batch_inference.rows import RUN_FIELDS, from_input
from batch_inference.storage.reshard import RefusedRecord, Source
from batch_inference.storage.sources import READABLE

log = logging.getLogger(__name__)

InputFormat = Literal["jsonl", "openai_batch", "parquet"]
T = TypeVar("T")

SAMPLE_WINDOW = 10_000  # records a run's start reads for its preflight sample (the whole input when smaller)


class InputError(SpecError):
    """The input cannot run as it is (the whole file, not one record): refused before any GPU time."""


def first_records(url: str, n: int, storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Up to ``n`` records from the start of a JSONL(.zst) file or JsonlDir (streamed; malformed lines skipped)."""
    return [rec for _, rec in first_numbered(url, n, storage_options)]


def first_numbered(url: str, n: int, storage_options: dict[str, Any] | None = None) -> list[tuple[int, dict[str, Any]]]:
    """``first_records`` with each record's 0-based line number, the one sharding makes its id from."""
    if n <= 0:
        return []
    source = open_input(url, storage_options)
    out: list[tuple[int, dict[str, Any]]] = []
    for item in source.iter_numbered_sync(on_error="quarantine", quarantine=lambda entry: None):
        out.append(item)
        if len(out) >= n:
            break
    return out


def evenly_spaced(n: int, take: int) -> list[int]:
    """Up to ``take`` distinct indices in ``range(n)``, evenly spaced, the first and the last included."""
    take = min(n, take)
    return sorted({round(i * (n - 1) / max(1, take - 1)) for i in range(take)}) if n else []


def spread(items: Iterable[T], n: int) -> list[T]:
    """Up to ``n`` of ``items``, evenly spaced over all of them (the first included), in one
    pass holding at most ``2n``: every ``stride``-th item is kept, and the stride doubles
    (every other kept item dropped) whenever ``2n`` are held. Deterministic: the same input
    gives the same sample."""
    if n <= 0:
        return []
    kept: list[T] = []
    stride = 1
    for i, item in enumerate(items):
        if i % stride:
            continue
        kept.append(item)
        if len(kept) >= 2 * n:
            kept, stride = kept[::2], stride * 2
    return kept if len(kept) <= n else [kept[i] for i in evenly_spaced(len(kept), n)]


def _readable(records: Iterable[T], n: int) -> Iterator[T]:
    """Up to ``n`` of ``records``, as far as they read: a shard damaged in storage is its
    task's to fail and quarantine with the reason, not the preflight's to refuse the run on."""
    try:
        yield from itertools.islice(records, n)
    except CorruptShardError as exc:
        log.debug("preflight sample: %s", exc)


def sample_numbered(url: str, n: int, storage_options: dict[str, Any] | None = None, *,
                    window: int = SAMPLE_WINDOW) -> list[tuple[int, dict[str, Any]]]:
    """``n`` records with their 0-based line numbers, spread across the input rather than
    its first ``n``: a committed directory (a run's ``sharded/``, in prefix order) gives the
    heads of evenly spaced shards (line numbers from its manifest), anything else the
    first ``window`` records (the whole input when smaller). Malformed lines are skipped."""
    if n <= 0:
        return []
    source = open_input(url, storage_options)

    def numbered(src: Any) -> Iterable[tuple[int, dict[str, Any]]]:
        return src.iter_numbered_sync(on_error="quarantine", quarantine=lambda entry: None)

    man = source.manifest() if isinstance(source, JsonlDir) else None
    if isinstance(source, JsonlDir) and man is not None and man.shards:
        shards = source.shards()
        records = {s["name"]: int(s["records"]) for s in man.shards}
        starts = list(itertools.accumulate((records.get(f.name, 0) for f in shards), initial=0))
        chosen = evenly_spaced(len(shards), n)
        per = -(-n // len(chosen))
        reads = max(per, window // len(chosen))
        out = [(starts[i] + line, rec) for i in chosen for line, rec in spread(_readable(numbered(shards[i]), reads), per)]
        return spread(out, n)
    return spread(itertools.islice(numbered(source), window), n)


def open_input(url: str, storage_options: dict[str, Any] | None = None) -> Source:
    """The input's reader (``storage.open_source``); an input that is not there, or a folder
    of files no reader reads, or a Parquet file that is not one, is an ``InputError`` naming
    what was found."""
    try:
        return open_source(url, storage_options)
    except UnreadableInputError as exc:
        raise InputError(f"input: {exc}") from None
    except FileNotFoundError:
        raise InputError(f"input: {JsonlFile(url, storage_options=storage_options).url} does not exist") from None


def check_records(spec: PipelineSpec, records: int, malformed: int | None = None) -> None:
    """Refuse an input that yields no records: a run of nothing that ends "converged" hides
    a wrong path or a format no reader reads. Lines that are none of them records (a
    ``.csv`` read as JSONL) are always refused; a truly empty input runs only when the spec
    says it may (``input: {url: ..., allow_empty: true}``). ``malformed``: the input's lines
    that were not records, when the caller counted them (else counted here)."""
    if records:
        return
    source = open_input(spec.input, spec.storage_options or None)
    if malformed is None:
        report = ReshardReport()
        for _ in source.iter_numbered_sync(on_error="quarantine", quarantine=report.count_malformed):
            pass
        malformed = report.malformed
    if malformed:
        raise InputError(f"input: {source.url} yields no records: {malformed} line(s), none of them a JSON object: "
                         f"not a format this input reads (it reads {READABLE})")
    if spec.input_options.allow_empty:
        return
    what = "an empty folder" if isinstance(source, JsonlDir) else "an empty file"
    raise InputError(f"input: {source.url} yields no records ({what}): nothing to run. If that is expected, say so: "
                     f"input: {{url: {spec.input}, allow_empty: true}}")


def stored_format(spec: PipelineSpec) -> Literal["jsonl", "parquet"]:
    """How the input is stored (``storage.input_format``), as an ``InputError`` when it cannot be read."""
    try:
        return input_format(spec.input, spec.storage_options or None)  # type: ignore[return-value]
    except UnreadableInputError as exc:
        raise InputError(f"input: {exc}") from None
    except FileNotFoundError:
        raise InputError(f"input: {JsonlFile(spec.input).url} does not exist") from None


def resolve_format(spec: PipelineSpec, first: list[dict[str, Any]] | None = None) -> tuple[InputFormat, bool]:
    """``(format, detected)``: the spec's ``input_format``, or for ``auto`` what the input is:
    Parquet by its files, OpenAI Batch by what the first record looks like."""
    stored = stored_format(spec)
    if stored == "parquet" or spec.input_format == "parquet":
        if stored != "parquet" or spec.input_format not in ("auto", "parquet"):
            raise InputError(f"input_format: {spec.input_format}, but {spec.input} is "
                             f"{'Parquet' if stored == 'parquet' else 'not a Parquet file or folder'} "
                             "(leave input_format auto to read it as it is)")
        return "parquet", spec.input_format == "auto"
    if spec.input_format != "auto":
        return spec.input_format, False
    if first is None:
        first = first_records(spec.input, 1, spec.storage_options or None)
    fmt: InputFormat = "openai_batch" if first and looks_like_openai_batch(first[0]) else "jsonl"
    return fmt, fmt == "openai_batch"


def schema_entry(source: Source) -> dict[str, Any]:
    """What the ledger records of the input's schema at sharding (``RunLayout.INPUT_SCHEMA``):
    a Parquet input's Arrow schema (what the Parquet export restores the columns' types from),
    else only the format."""
    if not isinstance(source, ParquetSource):
        return {"format": "jsonl", "arrow_schema": None}
    return {"format": "parquet", "arrow_schema": schema_to_text(source.schema), "files": len(source.files),
            "rows": source.rows, "columns": [f"{f.name}: {f.type}" for f in source.schema]}


def record_transform(spec: PipelineSpec, fmt: InputFormat,
                     reader: OpenAIBatchReader | None = None) -> Callable[[dict[str, Any], int], dict[str, Any]]:
    """How the shard step (and the preflight's sample) turns an input record into the run's:
    an OpenAI Batch line converted (``reader``), the input's fields named as the run's own kept
    aside and its position recorded (``rows.from_input``), and its id taken from the spec's
    ``id_field`` (a record without one raises ``RefusedRecord``: it is left out, named by file
    and line). With the default ``id_field: id``, a record without an ``id`` gets its line's
    number at sharding, as before."""
    id_field = spec.id_field
    if id_field != "id" and fmt == "openai_batch":
        raise InputError(f"id_field: {id_field!r}, but {spec.input} is an OpenAI Batch file: its ids are the lines' "
                         "custom_id (leave id_field out)")
    reserved = RUN_FIELDS if id_field == "id" else RUN_FIELDS | {"id"}  # the input's own `id` kept as it was

    def transform(rec: dict[str, Any], pos: int) -> dict[str, Any]:
        if reader is not None:
            rec = reader.convert(rec, pos)
        out = from_input(rec, pos, reserved)
        if id_field != "id":
            rid = rec.get(id_field)
            if rid is None:
                raise RefusedRecord(f"no id: the id column {id_field!r} (id_field) is {'null' if id_field in rec else 'missing'}")
            out["id"] = rid
        return out

    return transform


def openai_reader(spec: PipelineSpec) -> OpenAIBatchReader:
    """The converter for this run: the models it answers, whether its engine constrains output."""
    return OpenAIBatchReader(models=spec.accepted_models(), constrains=spec.engine.structured_output, embeds=spec.infer.task == "embed")


def check_openai_input(reader: OpenAIBatchReader, report: ReshardReport, source: str,
                       storage_options: dict[str, Any] | None = None) -> None:
    """Raise one ``InputError`` listing every file-level problem the sharding pass found.

    A duplicate custom_id is named with the ``file:line`` of each occurrence (a second pass
    over the input, made only for the file it refuses: ``accounting.id_lines``)."""
    if report.malformed:
        by_file: dict[str, list[str]] = {}
        for e in report.malformed_lines:
            by_file.setdefault(str(e["file"]), []).append(str(e["line"]))
        reader.file_problem("lines that are not JSON objects (quarantined at sharding)", report.malformed,
                            [f"{file} line {', '.join(lines)}" for file, lines in by_file.items()], unit="line(s)")
    if report.duplicate_ids:
        named = dict(itertools.islice(report.duplicate_ids.items(), EXAMPLES))
        src = open_input(source, storage_options)
        lines = id_lines(src.shards() if isinstance(src, JsonlDir) else [src], set(named), record_id)
        reader.file_problem("duplicate custom_id (each must be unique: it is the record id)",
                            sum(report.duplicate_ids.values()),
                            [f"custom_id {k!r} ({v}x: {', '.join(lines.get(k, []))})" for k, v in named.items()])
    message = reader.error(source)
    if message:
        raise InputError(message)
