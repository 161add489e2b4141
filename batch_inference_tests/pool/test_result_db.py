"""The local result cache's database: bulk writes, LRU eviction with running totals, and
several processes opening and writing one new store at once."""

from __future__ import annotations

import multiprocessing
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from batch_inference.pool.result_db import DB_NAME, DamagedStore, ResultDb


def blobs(prefix: str, n: int, size: int = 100) -> dict[str, bytes]:
    return {f"{prefix}{i:05d}": bytes([65 + i % 26]) * size for i in range(n)}


def test_a_missing_store_is_empty_and_never_created_by_a_read(tmp_path: Path) -> None:
    db = ResultDb(str(tmp_path / "store"))
    assert db.get_many(["a", "b"]) == {} and db.totals() == (0, 0) and db.evict(0) == (0, 0)
    assert not (tmp_path / "store").exists()


def test_put_get_and_the_running_totals(tmp_path: Path) -> None:
    db = ResultDb(str(tmp_path))
    db.put_many(blobs("a", 1200))  # more keys than one query takes
    assert db.totals() == (1200, 120_000)
    found = db.get_many([f"a{i:05d}" for i in range(0, 1300, 2)] + ["a00000"])
    assert len(found) == 600 and found["a00002"] == b"C" * 100
    db.put_many({"a00000": b"x" * 10})  # a write of a key again replaces it (a damaged entry is rewritten)
    assert db.get_many(["a00000"]) == {"a00000": b"x" * 10} and db.totals() == (1200, 119_910)


def test_evict_drops_the_least_recently_used_first(tmp_path: Path) -> None:
    db = ResultDb(str(tmp_path))
    db.put_many(blobs("old", 50), used={f"old{i:05d}": 1000.0 + i for i in range(50)})
    db.put_many(blobs("new", 50))
    db.get_many(["old00000", "old00001"])  # used now: the newest
    assert db.evict(6_000) == (40, 4_000)
    left = set(db.get_many(list(blobs("old", 50)) + list(blobs("new", 50))))
    assert left == {"old00000", "old00001"} | {f"old{i:05d}" for i in range(42, 50)} | set(blobs("new", 50))
    assert db.totals() == (60, 6_000) and db.evict(6_000) == (0, 0)


def test_a_damaged_file_is_named_with_what_to_do(tmp_path: Path) -> None:
    (tmp_path / DB_NAME).write_bytes(b"not a database" * 500)
    with pytest.raises(DamagedStore, match=f"{DB_NAME} is damaged .* delete it"):
        ResultDb(str(tmp_path)).get_many(["k"])


def _writer(folder: str, worker: int, start: Any) -> None:
    start.wait(30)
    db = ResultDb(folder)  # each process opens the new store itself, all at once
    for chunk in range(10):
        db.put_many(blobs(f"w{worker}-{chunk}-", 100))
        db.get_many(list(blobs(f"w{(worker + 1) % 4}-{chunk}-", 100)))


@pytest.mark.process
def test_processes_opening_and_writing_one_new_store_at_once_lose_nothing(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    writers = [ctx.Process(target=_writer, args=(str(tmp_path / "store"), w, start)) for w in range(4)]
    for w in writers:
        w.start()
    start.set()
    for w in writers:
        w.join(120)
    assert [w.exitcode for w in writers] == [0, 0, 0, 0]  # no "database is locked" in any of them
    db = ResultDb(str(tmp_path / "store"))
    assert db.totals() == (4_000, 400_000)
    with sqlite3.connect(tmp_path / "store" / DB_NAME) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("SELECT COUNT(*), SUM(length(blob)) FROM entries").fetchone() == (4_000, 400_000)
