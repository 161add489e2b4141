"""Where the API server keeps everything: uploaded files, batch state, the batches' runs.

Layout under ``storage``::

    files/<file-id>/meta.json      a file object (+ ``url``: where its bytes are, ``project``: whose it is)
    files/<file-id>/content        an upload's bytes
    batches/<batch-id>/state.json  a batch object (+ its ``project``), rewritten atomically at every change
    batches/<batch-id>/input.jsonl the requests its pipeline run reads (the batch's model only)
    batches/<batch-id>/rejected.jsonl  error lines the server itself wrote (a model not configured)
    batches/<batch-id>/deliveries/<output-file-id>/  one delivery's output.jsonl + batch_errors.jsonl, never rewritten
    batches/<batch-id>/export/     the same, as releases before opaque file ids wrote it (still served)
    runs/<batch-id>/               the batch's pipeline run (RunLayout)
    usage/<batch-id>.json          the batch's usage record (api/usage.py), kept when the batch is deleted

Ids are drawn here and checked on the way in (``check_id``): a fixed prefix, then letters
and digits only, so no id a client sends can name a path outside storage.
Every call blocks (fsspec): the server calls them through ``asyncio.to_thread``.
"""

from __future__ import annotations

import errno
import re
import time
import secrets
from collections.abc import Iterator
from typing import IO, Any

import orjson

from batch_inference.storage._io import AtomicFile
from batch_inference.storage.urls import fs_for, join

ID = re.compile(r"^(file|batch|msgbatch)([_-])[A-Za-z0-9]{8,64}$")
SEPARATOR = {"file": "-", "batch": "_", "msgbatch": "_"}  # as OpenAI's and Anthropic's ids: file-..., batch_..., msgbatch_...
READ_SIZE = 1 << 20


def new_id(prefix: str) -> str:
    """A fresh opaque id (``file-...``, ``batch_...``, ``msgbatch_...``): 24 random alphanumerics, nothing else."""
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return f"{prefix}{SEPARATOR[prefix]}" + "".join(secrets.choice(alphabet) for _ in range(24))


def check_id(value: str, prefix: str) -> bool:
    """True when ``value`` is an id of ours with ``prefix`` (never a path). File ids of earlier
    releases (``file_...``, ``file_<batch>output``) stay readable beside the opaque ``file-...``."""
    m = ID.match(value)
    return m is not None and m.group(1) == prefix and (m.group(2) == "_" or SEPARATOR[prefix] == "-")


class Store:
    """The server's storage (local folder or object store)."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        self.root = root.rstrip("/")
        self.storage_options = storage_options or {}
        self.fs, _ = fs_for(self.root, self.storage_options)

    # -- urls ----------------------------------------------------------------------

    def url(self, *parts: str) -> str:
        return join(self.root, *parts)

    def file_dir(self, file_id: str) -> str:
        return self.url("files", file_id)

    def batch_dir(self, batch_id: str) -> str:
        return self.url("batches", batch_id)

    @property
    def runs(self) -> str:
        return self.url("runs")

    def _path(self, url: str) -> str:
        return fs_for(url, self.storage_options)[1]

    # -- json objects ----------------------------------------------------------------

    def write_json(self, url: str, data: dict[str, Any]) -> None:
        """Replace ``url`` atomically: a reader (or a restarted server) sees the old or the new object."""
        f = AtomicFile(self.fs, self._path(url))
        try:
            f.write(orjson.dumps(data, option=orjson.OPT_INDENT_2))
            f.commit()
        except BaseException:
            f.discard()
            raise

    def read_json(self, url: str) -> dict[str, Any] | None:
        try:
            with self.fs.open(self._path(url), "rb") as f:
                return orjson.loads(f.read())
        except FileNotFoundError:
            return None

    def children(self, url: str) -> list[str]:
        """Names of the folders under ``url`` (ids), or none."""
        try:
            self.fs.invalidate_cache(self._path(url))
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self._path(url), detail=False)]
        except FileNotFoundError:
            return []

    # -- bytes -----------------------------------------------------------------------

    def open_writer(self, url: str) -> AtomicFile:
        """An atomic writer: the file appears whole on ``commit()`` or not at all."""
        return AtomicFile(self.fs, self._path(url))

    def size(self, url: str) -> int | None:
        try:
            return int(self.fs.size(self._path(url)))
        except FileNotFoundError:
            return None

    def chunks(self, url: str) -> Iterator[bytes]:
        """The bytes of ``url`` in 1 MiB pieces (FileNotFoundError when it is gone)."""
        with self.fs.open(self._path(url), "rb") as f:
            while chunk := f.read(READ_SIZE):
                yield chunk

    def snapshot(self, url: str) -> Snapshot:
        """``url`` opened once, for serving: its size and its bytes come from the same open file,
        so a response never pairs one version's length with another's bytes (FileNotFoundError when it is gone)."""
        return Snapshot(self.fs.open(self._path(url), "rb"))

    def lines(self, url: str) -> Iterator[bytes]:
        """The lines of ``url`` (without their newline), read in pieces."""
        with self.fs.open(self._path(url), "rb") as f:
            for raw in f:
                yield raw.rstrip(b"\r\n")

    def remove(self, url: str, *, attempts: int = 20, pause_s: float = 0.25) -> None:
        """Delete ``url`` (a file or a folder); gone already is fine.

        A stopped batch's last worker-side task may still write a checkpoint for a moment
        after the batch ended (a worker finishes a task its caller left, and commits
        nothing): a folder that filled up again while it was removed is removed again.
        """
        for attempt in range(attempts):
            try:
                self.fs.rm(self._path(url), recursive=True)
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno != errno.ENOTEMPTY or attempt == attempts - 1:
                    raise
                time.sleep(pause_s)


class Snapshot:
    """One open file read to the size it had when opened (blocking; ``close`` when done)."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        f.seek(0, 2)
        self.size = f.tell()
        f.seek(0)
        self._left = self.size

    def read(self) -> bytes:
        """The next piece (up to 1 MiB); empty at the end."""
        chunk = self._f.read(min(READ_SIZE, self._left)) if self._left > 0 else b""
        self._left -= len(chunk)
        return chunk

    def close(self) -> None:
        self._f.close()
