"""Which reader an input URL needs: a JSONL file, a folder of JSONL shards, or Parquet.

An input is classified once, by what is there, before anything reads it: a file by its
extension (``.parquet`` / ``.pq``: Parquet; anything else is read as JSONL, plain or
``.zst``), a folder (or an object-store prefix) by the files it holds. A folder is read
when every file in it is of one format the readers know; files of another format (a
folder of ``.csv``) are refused with their count and extension, never skipped: a skipped
file is records silently missing from the run. Hidden (``.``) and underscore names are
metadata (``_manifest.json``, locks) and never data. A folder with a committed manifest
(one the pipeline wrote) is read by its manifest.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from batch_inference.storage import urls
from batch_inference.storage.directory import SHARD_RE, JsonlDir, natural_key
from batch_inference.storage.errors import UnreadableInputError
from batch_inference.storage.file import JsonlFile
from batch_inference.storage.parquet import ParquetSource

PARQUET_SUFFIXES = (".parquet", ".pq")
READABLE = "JSONL (.jsonl, .jsonl.zst) or Parquet (.parquet)"


def is_parquet_name(name: str) -> bool:
    return name.lower().endswith(PARQUET_SUFFIXES)


def _kind(name: str) -> str:
    """How a listed data file is read: ``jsonl``, ``parquet`` or ``other`` (no reader)."""
    if SHARD_RE.match(name):
        return "jsonl"
    if is_parquet_name(name):
        return "parquet"
    return "other"


def pattern(name: str) -> str:
    """``*.csv`` for ``a.csv`` (two suffixes for ``a.csv.gz``); the name itself when it has none."""
    m = re.search(r"(\.[A-Za-z0-9]{1,8}){1,2}$", name)
    return f"*{m.group(0)}" if m else name


def describe_unread(names: list[str], folders: list[str]) -> str:
    """``3 files *.csv, 1 folder data/``: what a folder holds that no reader reads."""
    parts = [f"{n} file{'s' if n > 1 else ''} {pat}" for pat, n in sorted(Counter(map(pattern, names)).items())]
    if folders:
        shown = ", ".join(f"{f}/" for f in sorted(folders)[:3]) + (", ..." if len(folders) > 3 else "")
        parts.append(f"{len(folders)} folder{'s' if len(folders) > 1 else ''} {shown}")
    return ", ".join(parts)


def classify_folder(url: str, storage_options: dict[str, Any] | None = None) -> tuple[str, list[str]]:
    """``(format, file URLs in natural order)`` of a folder the readers read whole:
    ``jsonl`` or ``parquet`` (an empty folder: ``jsonl``, no files). Raises
    ``UnreadableInputError`` naming the files and folders of no known format, or a mix."""
    fs, path = urls.fs_for(url, storage_options)
    fs.invalidate_cache(path)
    entries = fs.ls(path, detail=True)
    files: dict[str, list[str]] = {"jsonl": [], "parquet": [], "other": []}
    folders: list[str] = []
    for e in entries:
        name = urls.basename(str(e["name"]))
        if name.startswith((".", "_")) or urls.normalize(str(e["name"])) == urls.normalize(path):
            continue
        if e.get("type") == "directory":
            folders.append(name)
        else:
            files[_kind(name)].append(name)
    known = [k for k in ("jsonl", "parquet") if files[k]]
    if files["other"] or folders:
        read = f" beside {len(files[known[0]])} it reads" if known else ""
        raise UnreadableInputError(urls.normalize(url), f"{describe_unread(files['other'], folders)}: not a format this "
                                   f"input reads{read} (a folder is read whole: {READABLE} files, no sub-folders)")
    if len(known) > 1:
        raise UnreadableInputError(urls.normalize(url), f"{describe_unread(files['jsonl'], [])} and "
                                   f"{describe_unread(files['parquet'], [])}: one folder holds one format")
    fmt = known[0] if known else "jsonl"
    return fmt, [urls.join(urls.normalize(url), n) for n in sorted(files[fmt], key=natural_key)]


def input_format(url: str, storage_options: dict[str, Any] | None = None) -> str:
    """``jsonl`` or ``parquet``: how the input at ``url`` is read (raises for a folder of
    no known format, ``FileNotFoundError`` when nothing is there)."""
    probe = JsonlFile(url, storage_options=storage_options)
    if probe.fs.isdir(probe.path):
        if JsonlDir(url, storage_options=storage_options).manifest() is not None:
            return "jsonl"
        return classify_folder(url, storage_options)[0]
    if not probe.exists_sync():
        raise FileNotFoundError(f"No such file or directory: {probe.url}")
    return "parquet" if is_parquet_name(probe.name) else "jsonl"


def open_source(url: str, storage_options: dict[str, Any] | None = None) -> JsonlFile | JsonlDir | ParquetSource:
    """The reader of the input at ``url`` (see the module docstring). A Parquet source reads
    every file's footer as it opens: a file that is not Parquet is refused here, named."""
    fmt = input_format(url, storage_options)
    probe = JsonlFile(url, storage_options=storage_options)
    folder = probe.fs.isdir(probe.path)
    if fmt == "parquet":
        files = classify_folder(url, storage_options)[1] if folder else [probe.url]
        return ParquetSource(url, files, storage_options=storage_options)
    return JsonlDir(url, storage_options=storage_options) if folder else probe


__all__ = ["PARQUET_SUFFIXES", "UnreadableInputError", "classify_folder", "describe_unread",
           "input_format", "is_parquet_name", "open_source"]
