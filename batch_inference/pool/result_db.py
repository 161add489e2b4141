"""The result cache on local disk: every entry in one SQLite file, a chunk's entries in one transaction.

A file per entry cost a folder and a file created per request: 0.23-0.38 ms of CPU each here,
most of it the kernel's (1.2-1.9 CPU-s for a 5,000-request batch, a third of the API server's
CPU over it), taken from the cores the engine runs on, and a store of millions of files. One
transaction writes a chunk's entries (12 µs each, ``bench/result_cache_writes.py``); a lookup is one indexed ``SELECT`` per 500 keys.

SQLite's own locking lets every worker on the machine share the file (processes, pods on a
host path); WAL mode lets lookups run beside a write. A network filesystem lacks the shared
memory WAL needs: a cache shared by machines belongs on an object store
(``pool.result_cache`` keeps one object per entry there).

The running totals (entries, bytes) are kept by triggers, so a trim reads them without a
scan; it deletes the least recently used entries (a hit refreshes ``used``) and hands the
freed pages back to the filesystem (``auto_vacuum = INCREMENTAL``).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence

DB_NAME = "entries.sqlite3"
BUSY_TIMEOUT_S = 60.0  # a writer waits this long for another's transaction (each takes milliseconds)
KEYS_PER_QUERY = 500  # under SQLite's bound on a statement's parameters, whatever its build

_SCHEMA = """
BEGIN IMMEDIATE;
CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, blob BLOB NOT NULL, used REAL NOT NULL) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS entries_by_use ON entries (used);
CREATE TABLE IF NOT EXISTS totals (one INTEGER PRIMARY KEY CHECK (one = 1), entries INTEGER NOT NULL, bytes INTEGER NOT NULL);
INSERT OR IGNORE INTO totals VALUES (1, 0, 0);
CREATE TRIGGER IF NOT EXISTS entry_added AFTER INSERT ON entries BEGIN
  UPDATE totals SET entries = entries + 1, bytes = bytes + length(NEW.blob); END;
CREATE TRIGGER IF NOT EXISTS entry_removed AFTER DELETE ON entries BEGIN
  UPDATE totals SET entries = entries - 1, bytes = bytes - length(OLD.blob); END;
CREATE TRIGGER IF NOT EXISTS entry_replaced AFTER UPDATE OF blob ON entries BEGIN
  UPDATE totals SET bytes = bytes - length(OLD.blob) + length(NEW.blob); END;
COMMIT;
"""

# An entry written again replaces a damaged one (content-addressed: a sound one is the same answer)
_UPSERT = ("INSERT INTO entries (key, blob, used) VALUES (?, ?, ?) "
           "ON CONFLICT (key) DO UPDATE SET blob = excluded.blob, used = excluded.used")


class DamagedStore(RuntimeError):
    """The store's file is not a sound SQLite database (foreign writes, a torn copy)."""


class ResultDb:
    """The entries of the store folder ``folder`` (``<folder>/entries.sqlite3``); blocking calls."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.path = os.path.join(folder, DB_NAME)
        self._ready = False

    @contextlib.contextmanager
    def _connection(self, *, create: bool) -> Iterator[sqlite3.Connection | None]:
        """A connection for one call (None: no store yet and ``create`` is false); the schema
        made once per instance. Autocommit: each call opens the transactions it needs."""
        if not create and not os.path.exists(self.path):
            yield None
            return
        if create:
            os.makedirs(self.folder, exist_ok=True)
        try:
            conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
            try:
                if not self._ready:
                    _make_schema(conn)
                    self._ready = True
                conn.execute("PRAGMA synchronous = NORMAL")  # WAL: a crash loses no committed entry, a power cut the last few
                yield conn
            finally:
                conn.close()
        except sqlite3.OperationalError as exc:  # locked past the timeout, unwritable, no space: said with the file
            raise OSError(f"{self.path}: {exc}") from exc
        except sqlite3.DatabaseError as exc:
            raise DamagedStore(f"{self.path} is damaged ({exc}): delete it to start the result cache afresh") from exc

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        """The stored blobs of ``keys`` that exist; each one found is marked used now."""
        with self._connection(create=False) as conn:
            if conn is None:
                return {}
            found: dict[str, bytes] = {}
            for part in _parts(keys):
                found.update(conn.execute(f"SELECT key, blob FROM entries WHERE key IN ({_marks(part)})", part).fetchall())
            if found:
                now = time.time()
                with _transaction(conn):
                    conn.executemany("UPDATE entries SET used = ? WHERE key = ?", ((now, k) for k in found))
            return found

    def put_many(self, blobs: Mapping[str, bytes], *, used: Mapping[str, float] | None = None) -> None:
        """Store ``blobs`` in one transaction (``used``: a last-use time other than now, per key)."""
        if not blobs:
            return
        now = time.time()
        with self._connection(create=True) as conn, _transaction(conn):
            conn.executemany(_UPSERT, ((k, b, (used or {}).get(k, now)) for k, b in blobs.items()))

    def totals(self) -> tuple[int, int]:
        """(entries, bytes of their blobs), read from the running totals."""
        with self._connection(create=False) as conn:
            if conn is None:
                return 0, 0
            entries, size = conn.execute("SELECT entries, bytes FROM totals").fetchone()
            return int(entries), int(size)

    def evict(self, max_bytes: int) -> tuple[int, int]:
        """Delete the least recently used entries until the blobs take at most ``max_bytes``:
        (entries evicted, their bytes)."""
        with self._connection(create=False) as conn:
            if conn is None:
                return 0, 0
            with _transaction(conn):  # one writer decides and deletes: two trims never both evict
                (total,) = conn.execute("SELECT bytes FROM totals").fetchone()
                if total <= max_bytes:
                    return 0, 0
                doomed, freed = [], 0
                for key, size in conn.execute("SELECT key, length(blob) FROM entries ORDER BY used"):
                    if total - freed <= max_bytes:
                        break
                    doomed.append((key,))
                    freed += size
                conn.executemany("DELETE FROM entries WHERE key = ?", doomed)
            conn.execute("PRAGMA incremental_vacuum")  # the freed pages back to the filesystem
            return len(doomed), freed


def _make_schema(conn: sqlite3.Connection) -> None:
    """WAL mode (and page reuse) before the tables, then the tables, once per file. Several
    workers open a new store at once: the switch to WAL fails at once, not after the busy
    timeout, while another connection holds the file, so it is retried here."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
        try:
            conn.execute("PRAGMA auto_vacuum = INCREMENTAL")  # takes effect in a file with no table yet
            conn.execute("PRAGMA journal_mode = WAL")
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    conn.executescript(_SCHEMA)


@contextlib.contextmanager
def _transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """One write transaction, taken at once (``IMMEDIATE``: waits for another writer up front
    instead of failing its upgrade from a read lock half-way)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _parts(keys: Sequence[str]) -> Iterable[list[str]]:
    unique = list(dict.fromkeys(keys))
    for i in range(0, len(unique), KEYS_PER_QUERY):
        yield unique[i:i + KEYS_PER_QUERY]


def _marks(part: Sequence[str]) -> str:
    return ",".join("?" * len(part))


__all__ = ["DB_NAME", "DamagedStore", "ResultDb"]
