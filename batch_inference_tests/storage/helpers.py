"""Storage test helpers: Parquet tables of every column type, and a Parquet file with a broken row group."""

from __future__ import annotations

import datetime as dt
import decimal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def every_type(n: int = 6) -> pa.Table:
    """A table of every kind of column a dataset carries, with nulls in each."""
    def some(values: list, every: int = 3) -> list:
        return [None if i % every == 1 else v for i, v in enumerate(values)]

    return pa.table({
        "id": pa.array(range(n), pa.int64()),
        "text": some([f"héllo 世界 {i} 🙂" for i in range(n)]),
        "big": pa.array(some([f"x{i}" for i in range(n)]), pa.large_string()),
        "score": pa.array(some([i / 3 for i in range(n)]), pa.float32()),
        "flag": some([i % 2 == 0 for i in range(n)]),
        "ts": pa.array(some([dt.datetime(2026, 1, 2, 3, 4, 5, 123456 + i % 1000) for i in range(n)]), pa.timestamp("us", tz="UTC")),
        "ts_ns": pa.array(some([dt.datetime(1999, 12, 31, 23, 59, i % 60) for i in range(n)]), pa.timestamp("ns")),
        "day": pa.array(some([dt.date(2026, 12, i % 28 + 1) for i in range(n)]), pa.date32()),
        "price": pa.array(some([decimal.Decimal(f"{i}.25") for i in range(n)]), pa.decimal128(9, 2)),
        "took": pa.array(some([dt.timedelta(milliseconds=i) for i in range(n)]), pa.duration("ms")),
        "at": pa.array(some([dt.time(1, 2, i % 60) for i in range(n)]), pa.time64("us")),
        "blob": pa.array(some([bytes([i % 256, 255, 0]) for i in range(n)]), pa.binary()),
        "kind": pa.array(some(["ab"[i % 2] for i in range(n)])).dictionary_encode(),
        "meta": pa.array(some([{"src": "wiki", "n": i, "seen": dt.date(2026, 1, 1)} for i in range(n)]),
                         pa.struct([("src", pa.string()), ("n", pa.int32()), ("seen", pa.date32())])),
        "tags": pa.array(some([[f"t{i}", None] if i % 2 else [] for i in range(n)]), pa.list_(pa.string())),
        "when": pa.array(some([[dt.datetime(2026, 1, 1, i % 24)] for i in range(n)]), pa.large_list(pa.timestamp("ms"))),
        "messages": pa.array(some([[{"role": "user", "content": f"hi {i}"}] for i in range(n)])),
    })


def broken_row_group(path: Path, rows: int = 300, group: int = 100, broken: int = 1) -> None:
    """A Parquet file whose footer reads but whose row group ``broken`` does not: its first
    page header overwritten with garbage."""
    pq.write_table(pa.table({"id": [f"r{i:04d}" for i in range(rows)], "prompt": [f"question {i}" for i in range(rows)]}),
                   path, row_group_size=group)
    offset = pq.ParquetFile(path).metadata.row_group(broken).column(0).data_page_offset
    data = bytearray(path.read_bytes())
    data[offset : offset + 16] = b"\xff" * 16
    path.write_bytes(bytes(data))
