"""The writer lock of a JsonlDir: one writer per directory, across processes and hosts.

The lock is a file created exclusively (``O_EXCL`` locally, ``If-None-Match`` on S3), so
exactly one writer wins. Its holder refreshes the heartbeat as it writes blocks; a lock
whose holder is dead (same host, pid gone) or not refreshed for ``LOCK_TTL_S`` is taken
over, and the writer that lost it finds out before it commits.
"""

from __future__ import annotations

import os
import socket
import time
import uuid

import fsspec
import orjson

from batch_inference.storage import _io
from batch_inference.storage.errors import ConcurrentWriteError

LOCK_NAME = "_writer.lock"
LOCK_TTL_S = 600.0  # a lock not refreshed for this long belongs to a dead writer


class DirLock:
    """The lock file ``<dir>/_writer.lock`` of one directory write, held under a fresh token."""

    def __init__(self, fs: fsspec.AbstractFileSystem, dir_path: str, url: str) -> None:
        self.fs = fs
        self.dir_path = dir_path
        self.url = url  # for errors
        self.token = uuid.uuid4().hex
        self.path = f"{dir_path}/{LOCK_NAME}"
        self._last_beat = 0.0

    def _body(self) -> bytes:
        return orjson.dumps({"token": self.token, "host": socket.gethostname(), "pid": os.getpid(), "heartbeat": time.time()})

    def holder(self) -> dict | None:
        """What the lock file says now (None: no lock, or one being replaced)."""
        try:
            with self.fs.open(self.path, "rb") as f:
                return orjson.loads(f.read())
        except (FileNotFoundError, orjson.JSONDecodeError):
            return None

    def taken_over(self) -> bool:
        """Another writer holds the lock now (it judged this one dead)."""
        holder = self.holder()
        return holder is not None and holder.get("token") != self.token

    @staticmethod
    def _stale(holder: dict) -> bool:
        if time.time() - holder.get("heartbeat", 0) > LOCK_TTL_S:
            return True
        if holder.get("host") == socket.gethostname():
            try:
                os.kill(int(holder["pid"]), 0)
            except ProcessLookupError:
                return True
            except (PermissionError, KeyError, ValueError):
                return False
        return False

    def acquire(self) -> None:
        """Take the lock, or a dead writer's; ``ConcurrentWriteError`` if a live one holds it."""
        fs = self.fs
        fs.makedirs(self.dir_path, exist_ok=True)
        for _ in range(2):
            try:
                with fs.open(self.path, "xb") as f:  # O_EXCL / If-None-Match: one winner
                    f.write(self._body())
                self._last_beat = time.monotonic()
                return
            except OSError as exc:
                if not _io.create_refused(exc):
                    raise
            holder = self.holder()
            if holder is not None and not self._stale(holder):
                raise ConcurrentWriteError(self.url, holder, "directory is being written by another writer") from None
            fs.rm(self.path)  # a dead writer's lock
        raise ConcurrentWriteError(self.url, self.holder(), "could not take the directory lock")

    def heartbeat(self) -> None:
        """Refresh the heartbeat when a tenth of the TTL has passed (called once per block)."""
        if time.monotonic() - self._last_beat < LOCK_TTL_S / 10:
            return
        self.verify()
        beat = _io.AtomicFile(self.fs, self.path)  # never seen truncated: a reader must not
        beat.write(self._body())  # take an empty lock file for a dead writer's
        beat.commit()
        self._last_beat = time.monotonic()

    def verify(self) -> None:
        """Raise ``ConcurrentWriteError`` unless this writer still holds the lock."""
        holder = self.holder()
        if holder is None or holder.get("token") != self.token:
            raise ConcurrentWriteError(self.url, holder, "lost the directory lock to another writer")

    def release(self) -> None:
        """Remove the lock if it is still this writer's."""
        holder = self.holder()
        if holder is not None and holder.get("token") == self.token:
            self.fs.rm(self.path)
