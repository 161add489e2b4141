"""JSONL input as a stored format: ``*.jsonl`` / ``*.jsonl.zst`` files (``JsonlFile``), a folder
of them (``JsonlDir``). The default: a single file no format claims is read as JSONL."""

from __future__ import annotations

from typing import Any

from batch_inference.storage.directory import JsonlDir
from batch_inference.storage.file import JsonlFile
from batch_inference.storage.formats import SourceFormat


def open_jsonl(url: str, files: list[str], folder: bool, storage_options: dict[str, Any] | None) -> JsonlFile | JsonlDir:
    """A folder reads its shards itself (its manifest, else its listing), a file is one stream."""
    return JsonlDir(url, storage_options=storage_options) if folder else JsonlFile(url, storage_options=storage_options)


SOURCE = SourceFormat("jsonl", "JSONL (.jsonl, .jsonl.zst)", (".jsonl", ".jsonl.zst"), open_jsonl)
