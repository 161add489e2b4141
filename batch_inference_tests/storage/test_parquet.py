"""Parquet in and out at the storage layer: rows as records and back with their Arrow types,
a corrupt file refused by name, a row group that breaks quarantined by file and row."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batch_inference.storage import JsonlDir, UnreadableInputError, open_source, reshard
from batch_inference.storage.parquet import CorruptInputError, ParquetSource, schema_from_text, schema_to_text, table_of, write_rows
from batch_inference_tests.storage.helpers import broken_row_group, every_type


def test_every_type_survives_records_and_back(tmp_path: Path) -> None:
    """Nested types, nulls, timestamps, decimals, binary and non-ASCII text: through records
    (as JSON, as the shards store them) and back to the same Arrow table."""
    table = every_type()
    pq.write_table(table, tmp_path / "in.parquet", row_group_size=4)
    source = open_source(str(tmp_path / "in.parquet"))
    assert isinstance(source, ParquetSource) and source.rows == 6
    numbered = list(source.iter_numbered_sync())
    assert [i for i, _ in numbered] == list(range(6))
    first = numbered[0][1]
    assert first["text"] == "héllo 世界 0 🙂" and first["ts"].startswith("2026-01-02 03:04:05.123456")
    assert first["meta"] == {"src": "wiki", "n": 0, "seen": "2026-01-01"} and first["price"] == "0.25"
    assert numbered[1][1]["meta"] is None and numbered[1][1]["tags"] is None
    records = [orjson.loads(orjson.dumps(rec)) for _, rec in numbered]
    schema = schema_from_text(schema_to_text(source.schema))
    back = table_of(records, schema)
    assert back.schema == pq.read_schema(tmp_path / "in.parquet")
    assert back.equals(pq.read_table(tmp_path / "in.parquet"))


def test_a_folder_is_read_in_name_order_with_rows_numbered_across_files(tmp_path: Path) -> None:
    folder = tmp_path / "drop"
    folder.mkdir()
    for f in (10, 2, 1):  # natural order: part-1, part-2, part-10
        pq.write_table(pa.table({"n": [f * 100 + i for i in range(3)]}), folder / f"part-{f}.parquet")
    (folder / "_SUCCESS").write_text("")
    source = open_source(str(folder))
    assert isinstance(source, ParquetSource) and source.rows == 9
    assert [(i, r["n"]) for i, r in source.iter_numbered_sync()] == [
        (0, 100), (1, 101), (2, 102), (3, 200), (4, 201), (5, 202), (6, 1000), (7, 1001), (8, 1002)]
    report = reshard(str(folder), str(tmp_path / "sharded"), records_per_shard=4)
    assert report.records == 9 and report.shards == 3 and report.ids_assigned == 9
    assert [r["id"] for r in JsonlDir(str(tmp_path / "sharded")).iter_records_sync()][:2] == ["000000000000", "000000000001"]


def test_a_file_that_is_not_parquet_is_refused_naming_it(tmp_path: Path) -> None:
    folder = tmp_path / "drop"
    folder.mkdir()
    pq.write_table(pa.table({"n": [1]}), folder / "a.parquet")
    good = (folder / "a.parquet").read_bytes()
    (folder / "b.parquet").write_bytes(good[: len(good) // 2])  # truncated: no footer
    with pytest.raises(CorruptInputError, match="b.parquet: not a readable Parquet file"):
        open_source(str(folder))
    (folder / "b.parquet").write_bytes(b"id,prompt\n1,hello\n")
    with pytest.raises(CorruptInputError, match="b.parquet"):
        open_source(str(folder / "b.parquet"))


def test_files_of_another_schema_are_refused_naming_the_file(tmp_path: Path) -> None:
    pq.write_table(pa.table({"n": [1]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"n": ["one"]}), tmp_path / "b.parquet")
    with pytest.raises(UnreadableInputError, match="b.parquet: its columns differ from a.parquet's: n: string vs n: int64"):
        open_source(str(tmp_path))


def test_parquet_beside_jsonl_is_refused(tmp_path: Path) -> None:
    pq.write_table(pa.table({"n": [1]}), tmp_path / "a.parquet")
    (tmp_path / "b.jsonl").write_text('{"n": 2}\n')
    with pytest.raises(UnreadableInputError, match=r"1 file \*.jsonl and 1 file \*.parquet: one folder holds one format"):
        open_source(str(tmp_path))


def test_a_row_group_that_breaks_while_read_is_quarantined_by_file_and_row(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    broken_row_group(path)
    source = open_source(str(path))  # the footer is fine: opened
    with pytest.raises(CorruptInputError, match="row group 1 of in.parquet unreadable"):
        list(source.iter_records_sync())
    entries: list[dict] = []
    rows = list(source.iter_numbered_sync(on_error="quarantine", quarantine=entries.append))
    assert [r["id"] for _, r in rows] == [f"r{i:04d}" for i in (*range(100), *range(200, 300))]
    assert [i for i, _ in rows][100] == 200  # rows keep their numbers (assigned ids name the row)
    assert [e["line"] for e in entries] == list(range(101, 201))
    assert all(e["file"] == str(path) and "row group 1" in e["reason"] for e in entries)


def test_written_parquet_appears_whole_with_its_schema(tmp_path: Path) -> None:
    schema = pa.schema([("id", pa.string()), ("when", pa.timestamp("ms"))])
    rows = [{"id": str(i), "when": "2026-01-01 00:00:00"} for i in range(25)]
    written = write_rows(str(tmp_path / "out"), schema, iter(rows), batch_rows=10, rows_per_file=10)
    assert [Path(f).name for f in written.files] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [Path(f).name for f in written.files]  # no temp files
    table = pq.read_table(tmp_path / "out")
    assert table.num_rows == 25 and table.schema == schema

    def dying() -> Iterator[dict]:
        yield from rows[:15]
        raise RuntimeError("died")

    with pytest.raises(RuntimeError, match="died"):
        write_rows(str(tmp_path / "again"), schema, dying(), batch_rows=10, rows_per_file=10)
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == ["part-00000.parquet"]  # the cut file never appeared
    empty = write_rows(str(tmp_path / "none"), schema, iter([]))
    assert pq.read_table(empty.files[0]).schema == schema


async def test_parquet_on_s3(s3_store, s3_store_bucket: str, tmp_path: Path) -> None:
    """A prefix of Parquet files on a real S3 server (moto; SeaweedFS under infra), read through s3fs."""
    so = s3_store.storage_options
    fs, _ = __import__("fsspec").core.url_to_fs(s3_store_bucket, **so)
    table = every_type()
    for i in range(2):
        pq.write_table(table, tmp_path / f"p{i}.parquet", row_group_size=4)
        fs.put(str(tmp_path / f"p{i}.parquet"), f"{s3_store_bucket}/drop/part-{i}.parquet".split("://", 1)[1])
    source = open_source(f"{s3_store_bucket}/drop", so)
    assert isinstance(source, ParquetSource) and source.rows == 12
    records = [orjson.loads(orjson.dumps(r)) for r in source.iter_records_sync()]
    assert table_of(records[:6], source.schema).equals(pq.read_table(tmp_path / "p0.parquet"))
    report = reshard(f"{s3_store_bucket}/drop", f"{s3_store_bucket}/sharded", records_per_shard=5, storage_options=so)
    assert report.records == 12 and report.shards == 3
