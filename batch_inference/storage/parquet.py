"""Parquet in and out: a Parquet file or folder read as records, and records written back
as Parquet with the input's own Arrow types.

Reading streams row group by row group, ``BATCH_ROWS`` rows at a time (memory: one row
group's column chunks and one batch, whatever the file's size). Each row is a record
and each column a field; values become what JSON holds, losslessly for the types a
record carries (``jsonable_type``): timestamps, dates and decimals as ISO / decimal
strings, times and durations as integers of their unit, binary as base64, a float's NaN and
infinities as ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` (JSON has none of them); structs,
lists and nulls stay structs, lists and nulls. ``restore`` turns such records back
into the original Arrow types, from the schema recorded when the input was read
(``schema_to_text`` / ``schema_from_text``).

A file whose footer cannot be read is refused when the source is opened
(``CorruptInputError`` naming it). A row group that breaks while it is read raises the
same error, or with ``on_error="quarantine"`` its unread rows go to the quarantine sink
(one entry per row, naming the file, row group and row) and the rest is read.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batch_inference.storage import urls
from batch_inference.storage._io import AtomicFile
from batch_inference.storage.errors import UnreadableInputError
from batch_inference.storage.file import OnError, QuarantineSink, sync_sink
from batch_inference.storage.formats import SourceFormat

BATCH_ROWS = 8192  # rows decoded at a time: one batch of Python dicts in memory


class CorruptInputError(UnreadableInputError):
    """A Parquet file that cannot be read (not Parquet, a damaged footer or page)."""


# ---------------------------------------------------------------- types


def _temporal_as_text(t: pa.DataType) -> bool:
    return pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_decimal(t)


def _temporal_as_int(t: pa.DataType) -> bool:
    return pa.types.is_time(t) or pa.types.is_duration(t)


def _is_binary(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def jsonable_type(t: pa.DataType) -> pa.DataType:
    """The Arrow type a column of ``t`` has in a record (what JSON holds without loss)."""
    if _temporal_as_text(t) or _is_binary(t):
        return pa.string()
    if _temporal_as_int(t):
        return pa.int64()
    if pa.types.is_dictionary(t):
        return jsonable_type(t.value_type)
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, jsonable_type(f.type), f.nullable) for f in t])
    if _is_list(t):
        return pa.list_(pa.field(t.value_field.name, jsonable_type(t.value_type), t.value_field.nullable))
    if pa.types.is_map(t):
        return pa.map_(jsonable_type(t.key_type), jsonable_type(t.item_type))
    return t


def _mask(arr: pa.Array) -> pa.Array | None:
    return arr.is_null() if arr.null_count else None


def to_jsonable(arr: pa.Array) -> pa.Array:
    """``arr`` as ``jsonable_type(arr.type)`` (columns that need nothing are returned as they are)."""
    t = arr.type
    if jsonable_type(t) == t:
        return arr
    if pa.types.is_dictionary(t):
        return to_jsonable(arr.dictionary_decode())
    if _temporal_as_text(t) or _temporal_as_int(t):
        return arr.cast(jsonable_type(t))
    if _is_binary(t):
        return pa.array([None if v is None else base64.b64encode(v).decode() for v in arr.to_pylist()], pa.string())
    if pa.types.is_struct(t):
        children = [to_jsonable(child) for child in arr.flatten()]  # a null struct's fields null too
        return pa.StructArray.from_arrays(children, fields=list(jsonable_type(t)), mask=_mask(arr))
    if _is_list(t):
        flat = arr.cast(pa.list_(t.value_field)) if not pa.types.is_list(t) else arr
        return pa.ListArray.from_arrays(flat.offsets, to_jsonable(flat.values), type=jsonable_type(t), mask=_mask(flat))
    return pa.array(arr.to_pylist(), jsonable_type(t))  # maps: rare; through Python


def restore(arr: pa.Array, t: pa.DataType) -> pa.Array:
    """The inverse of ``to_jsonable``: an array of ``jsonable_type(t)`` as type ``t``."""
    if jsonable_type(t) == t:
        return arr.cast(t) if arr.type != t else arr
    if pa.types.is_dictionary(t):
        return restore(arr, t.value_type).dictionary_encode().cast(t)
    if _temporal_as_text(t) or _temporal_as_int(t):
        return arr.cast(t)
    if _is_binary(t):
        return pa.array([None if v is None else base64.b64decode(v) for v in arr.to_pylist()], t)
    if pa.types.is_struct(t):
        children = [restore(child, f.type) for child, f in zip(arr.flatten(), t)]
        return pa.StructArray.from_arrays(children, fields=list(t), mask=_mask(arr))
    if _is_list(t):
        out = pa.ListArray.from_arrays(arr.offsets, restore(arr.values, t.value_type), type=pa.list_(t.value_field),
                                       mask=_mask(arr))
        return out.cast(t) if out.type != t else out
    return pa.array(arr.to_pylist(), t)


# JSON has no NaN or infinity (orjson writes them as null): a float column's non-finite values
# travel as these strings, and the column's recorded Arrow type turns them back into floats.
NON_FINITE: dict[str, float] = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _has_float(t: pa.DataType) -> bool:
    """Whether values of ``t`` (a ``jsonable_type``) can hold a float, at any depth."""
    if pa.types.is_floating(t):
        return True
    if pa.types.is_struct(t):
        return any(_has_float(f.type) for f in t)
    if _is_list(t):
        return _has_float(t.value_type)
    if pa.types.is_map(t):
        return _has_float(t.key_type) or _has_float(t.item_type)
    return False


def _float_text(x: float) -> str | float:
    if math.isfinite(x):
        return x
    return "NaN" if x != x else ("Infinity" if x > 0 else "-Infinity")


def _floats(value: Any, t: pa.DataType, convert: Callable[[Any], Any]) -> Any:
    """``value`` (of ``jsonable_type`` ``t``, as Python) with ``convert`` applied to its floats."""
    if value is None:
        return None
    if pa.types.is_floating(t):
        return convert(value)
    if pa.types.is_struct(t):
        return {**value, **{f.name: _floats(value.get(f.name), f.type, convert) for f in t if _has_float(f.type)}}
    if _is_list(t):
        return [_floats(v, t.value_type, convert) for v in value]
    if pa.types.is_map(t):
        return [(_floats(k, t.key_type, convert), _floats(v, t.item_type, convert)) for k, v in value]
    return value


def _decode_float(value: Any) -> Any:
    return NON_FINITE[value] if isinstance(value, str) and value in NON_FINITE else value


def _has_non_finite(arr: pa.Array) -> bool:
    if pa.types.is_floating(arr.type) and not pa.types.is_float16(arr.type):
        return bool(pc.any(pc.invert(pc.is_finite(arr))).as_py())
    return True  # nested (or half) floats: looked at value by value


def records_of(batch: pa.RecordBatch) -> list[dict[str, Any]]:
    """A batch's rows as records (``to_jsonable`` per column; non-finite floats as ``NON_FINITE`` text)."""
    if all(jsonable_type(f.type) == f.type for f in batch.schema):
        cols = list(batch.columns)
        recs = batch.to_pylist()
    else:
        cols = [to_jsonable(c) for c in batch.columns]
        recs = pa.RecordBatch.from_arrays(cols, names=batch.schema.names).to_pylist()
    for name, col in zip(batch.schema.names, cols):
        if _has_float(col.type) and _has_non_finite(col):
            for rec in recs:
                rec[name] = _floats(rec[name], col.type, _float_text)
    return recs


def table_of(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    """Records back as a table of ``schema`` (the fields a row lacks are null; ``NON_FINITE``
    text in a float column is the float again)."""
    cols = []
    for f in schema:
        t = jsonable_type(f.type)
        if _has_float(t):
            values = pa.array([_floats(r.get(f.name), t, _decode_float) for r in rows], t)
        else:
            values = pa.array([r.get(f.name) for r in rows], t)
        cols.append(restore(values, f.type))
    return pa.Table.from_arrays(cols, schema=schema)


def schema_to_text(schema: pa.Schema) -> str:
    """The schema, metadata included, as base64 of its Arrow IPC form (for a JSON ledger entry)."""
    return base64.b64encode(schema.serialize().to_pybytes()).decode()


def schema_from_text(text: str) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


# ---------------------------------------------------------------- reading


class ParquetSource:
    """Parquet files read as one stream of records, in the order given (a folder: natural name order).

    Opening reads every file's footer: a file that is not Parquet, or whose schema differs
    from the first file's, is refused here, naming it.
    """

    def __init__(self, url: str, files: list[str], *, storage_options: dict[str, Any] | None = None) -> None:
        self.url = urls.normalize(url)
        self.files = files
        self.storage_options = storage_options
        self.fs, _ = urls.fs_for(self.url, storage_options)
        self.rows_by_file: list[int] = []
        schema: pa.Schema | None = None
        for file in files:
            meta = self._metadata(file)
            self.rows_by_file.append(meta.num_rows)
            file_schema = meta.schema.to_arrow_schema()
            if schema is None:
                schema = file_schema
            elif not file_schema.equals(schema):
                raise UnreadableInputError(file, f"its columns differ from {urls.basename(files[0])}'s: "
                                           f"{_columns(file_schema)} vs {_columns(schema)} (one folder, one schema)")
        self.schema: pa.Schema = schema if schema is not None else pa.schema([])

    def __repr__(self) -> str:
        return f"ParquetSource({self.url!r}, {len(self.files)} file(s))"

    @property
    def rows(self) -> int:
        """Rows in every file, from the footers (nothing read)."""
        return sum(self.rows_by_file)

    def _open(self, file: str) -> pq.ParquetFile:
        """The file's reader (footer read); the caller closes it."""
        fs, path = urls.fs_for(file, self.storage_options)
        try:
            return pq.ParquetFile(path if urls.is_local(fs) else fs.open(path, "rb"))
        except FileNotFoundError:
            raise
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise CorruptInputError(file, f"not a readable Parquet file ({type(exc).__name__}: {exc})") from None

    def _metadata(self, file: str) -> pq.FileMetaData:
        pf = self._open(file)
        try:
            return pf.metadata
        finally:
            pf.close(force=True)

    def exists_sync(self) -> bool:
        return True  # opened: every file's footer was read

    def iter_numbered_sync(self, *, on_error: OnError = "raise",
                           quarantine: QuarantineSink | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(0-based row number across the files, record)``, row group by row group."""
        sink = sync_sink(on_error, quarantine)
        base = 0
        for file, n_rows in zip(self.files, self.rows_by_file):
            yield from self._file_rows(file, base, on_error, sink)
            base += n_rows

    def iter_records_sync(self, *, on_error: OnError = "raise", quarantine: QuarantineSink | None = None) -> Iterator[dict]:
        return (rec for _, rec in self.iter_numbered_sync(on_error=on_error, quarantine=quarantine))

    def _file_rows(self, file: str, base: int, on_error: str,
                   sink: Callable[[dict[str, Any]], None]) -> Iterator[tuple[int, dict[str, Any]]]:
        pf = self._open(file)
        try:
            meta = pf.metadata
            first = 0  # this row group's first row in the file
            for g in range(meta.num_row_groups):
                group_rows = meta.row_group(g).num_rows
                done = 0
                try:
                    for batch in pf.iter_batches(batch_size=BATCH_ROWS, row_groups=[g], use_threads=False):
                        recs = records_of(batch)
                        for k, rec in enumerate(recs):
                            yield base + first + done + k, rec
                        done += len(recs)
                except (pa.ArrowException, OSError, ValueError) as exc:
                    reason = f"row group {g} of {urls.basename(file)} unreadable ({type(exc).__name__}: {exc})"
                    if on_error != "quarantine":
                        raise CorruptInputError(file, reason) from None
                    for row in range(first + done, first + group_rows):  # one entry per record never read
                        sink({"file": file, "line": row + 1, "reason": reason, "raw": "", "row_group": g})
                first += group_rows
        finally:
            pf.close(force=True)


def _columns(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name}: {f.type}" for f in schema)


# ---------------------------------------------------------------- writing


class _AtomicSink:
    """A write-only file over ``AtomicFile`` for ``pq.ParquetWriter`` (visible on commit only)."""

    def __init__(self, fs: Any, path: str) -> None:
        self._file = AtomicFile(fs, path)
        self._pos = 0
        self.closed = False

    def write(self, data: bytes) -> int:
        self._file.write(bytes(data))
        self._pos += len(data)
        return len(data)

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        pass

    def close(self) -> None:  # the writer closes its sink; commit / discard decide what stays
        self.closed = True


class ParquetDirWriter:
    """Writes tables as ``part-NNNNN.parquet`` under ``url``, a new file every ``rows_per_file``
    rows; each file appears only once complete. The folder's earlier parts are removed first."""

    def __init__(self, url: str, schema: pa.Schema, *, rows_per_file: int = 1_000_000,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.url = urls.normalize(url)
        self.schema, self.rows_per_file = schema, rows_per_file
        self.fs, self.path = urls.fs_for(self.url, storage_options)
        self.files: list[str] = []
        self.rows = 0
        self._sink: _AtomicSink | None = None
        self._writer: pq.ParquetWriter | None = None
        self._in_file = 0

    def __enter__(self) -> ParquetDirWriter:
        if self.fs.isdir(self.path):
            for old in self.fs.ls(self.path, detail=False):
                if str(old).endswith(".parquet"):
                    self.fs.rm(old)
        else:
            self.fs.makedirs(self.path, exist_ok=True)
        return self

    def _next_file(self) -> pq.ParquetWriter:
        name = f"part-{len(self.files):05d}.parquet"
        self._sink = _AtomicSink(self.fs, f"{self.path}/{name}")
        self._writer = pq.ParquetWriter(self._sink, self.schema)
        self.files.append(urls.join(self.url, name))
        return self._writer

    def write(self, table: pa.Table) -> None:
        start = 0
        while start < table.num_rows:
            if self._writer is None:
                self._next_file()
            assert self._writer is not None
            take = min(table.num_rows - start, self.rows_per_file - self._in_file)
            self._writer.write_table(table.slice(start, take))
            self._in_file += take
            self.rows += take
            start += take
            if self._in_file >= self.rows_per_file:
                self._commit()

    def _commit(self) -> None:
        assert self._writer is not None and self._sink is not None
        self._writer.close()
        self._sink._file.commit()
        self._writer, self._sink, self._in_file = None, None, 0

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if self._writer is None:
            if exc_type is None and not self.files:  # no rows: one file with the schema, so readers see the columns
                self._next_file()
                self._commit()
            return
        if exc_type is None:
            self._commit()
        else:
            self._sink._file.discard()  # type: ignore[union-attr]
            self.files.pop()


def write_rows(url: str, schema: pa.Schema, rows: Iterable[dict[str, Any]], *, batch_rows: int = 10_000,
               rows_per_file: int = 1_000_000, storage_options: dict[str, Any] | None = None) -> ParquetDirWriter:
    """Records as Parquet files of ``schema`` under ``url`` (``table_of`` per batch; blocking)."""
    with ParquetDirWriter(url, schema, rows_per_file=rows_per_file, storage_options=storage_options) as w:
        batch: list[dict[str, Any]] = []
        for row in rows:
            batch.append(row)
            if len(batch) >= batch_rows:
                w.write(table_of(batch, schema))
                batch = []
        if batch:
            w.write(table_of(batch, schema))
    return w


def open_parquet(url: str, files: list[str], folder: bool, storage_options: dict[str, Any] | None) -> ParquetSource:
    """Every file's footer is read as it opens: a file that is not Parquet is refused here, named."""
    return ParquetSource(url, files, storage_options=storage_options)


SOURCE = SourceFormat("parquet", "Parquet (.parquet)", (".parquet", ".pq"), open_parquet, magic=b"PAR1", ignore_case=True)
