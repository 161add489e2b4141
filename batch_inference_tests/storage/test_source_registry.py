"""A stored input format is one registration (``storage.sources.register_source``): its
suffix or magic picks it, its reader feeds sharding, and nothing else is edited."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batch_inference.storage import JsonlDir, UnreadableInputError, input_format, open_source, reshard
from batch_inference.storage.formats import SourceFormat
from batch_inference.storage.parquet import ParquetSource
from batch_inference.storage.sources import readable, register_source, unregister_source


class CsvSource:
    """CSV files read as one stream of records (a header row, then one record a row)."""

    def __init__(self, url: str, files: list[str]) -> None:
        self.url = url
        self.files = files

    def iter_numbered_sync(self, *, on_error: str = "raise", quarantine: Any = None) -> Iterator[tuple[int, dict[str, Any]]]:
        pos = 0
        for file in self.files:
            text = Path(file.removeprefix("file://")).read_text()
            for row in csv.DictReader(io.StringIO(text.removeprefix("#csv\n"))):
                yield pos, dict(row)
                pos += 1


CSV = SourceFormat("csv", "CSV (.csv)", (".csv",), lambda url, files, folder, so: CsvSource(url, files), magic=b"#csv")


@pytest.fixture
def csv_format() -> Iterator[SourceFormat]:
    yield register_source(CSV)
    unregister_source("csv")


def test_without_the_format_a_csv_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("id,q\n1,x\n")
    with pytest.raises(UnreadableInputError, match=r"1 file \*\.csv: not a format this input reads"):
        input_format(str(tmp_path))


def test_a_registered_format_is_picked_by_suffix_and_shards(tmp_path: Path, csv_format: SourceFormat) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "b-2.csv").write_text("id,q\n3,z\n")
    (folder / "b-10.csv").write_text("id,q\n4,w\n")
    (folder / "a.csv").write_text("id,q\n1,x\n2,y\n")
    assert input_format(str(folder)) == "csv" and input_format(str(folder / "a.csv")) == "csv"
    source = open_source(str(folder))
    assert isinstance(source, CsvSource) and [Path(f).name for f in source.files] == ["a.csv", "b-2.csv", "b-10.csv"]
    report = reshard(str(folder), str(tmp_path / "sharded"), records_per_shard=2)
    assert report.records == 4
    assert [r["q"] for r in JsonlDir(str(tmp_path / "sharded")).iter_records_sync()] == ["x", "y", "z", "w"]
    assert readable() == "JSONL (.jsonl, .jsonl.zst), Parquet (.parquet) or CSV (.csv)"


def test_a_registered_format_is_picked_by_magic_and_one_folder_holds_one_format(tmp_path: Path, csv_format: SourceFormat) -> None:
    data = tmp_path / "rows.data"
    data.write_text("#csv\nid,q\n1,x\n")
    assert input_format(str(data)) == "csv"
    assert [rec for _, rec in open_source(str(data)).iter_numbered_sync()] == [{"id": "1", "q": "x"}]
    (tmp_path / "plain.txt").write_text('{"id": 1}\n')
    assert input_format(str(tmp_path / "plain.txt")) == "jsonl"  # no suffix, no magic: JSONL as before
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.csv").write_text("id\n1\n")
    (mixed / "b.jsonl").write_text('{"id": 2}\n')
    with pytest.raises(UnreadableInputError, match="one folder holds one format"):
        input_format(str(mixed))


def test_parquet_is_picked_by_magic_too(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": ["a"], "q": ["x"]}), tmp_path / "export.bin")
    source = open_source(str(tmp_path / "export.bin"))
    assert isinstance(source, ParquetSource) and [rec["q"] for _, rec in source.iter_numbered_sync()] == ["x"]
