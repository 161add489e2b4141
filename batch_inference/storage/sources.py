"""Which reader an input URL needs: one registry of stored formats, picked by name or magic.

Each format is declared in a file of its own (``storage/jsonl.py``, ``storage/parquet.py``:
a ``SourceFormat`` with its suffixes, optional magic bytes and reader factory) and
registered here (``register_source``). An input is classified once, by what is there,
before anything reads it: a file by its name (a format's suffix), else by its first bytes
(a format's magic), else it is read as JSONL (plain or ``.zst``); a folder (or an
object-store prefix) by the files it holds. A folder is read when every file in it is of
one registered format; files of another (a folder of ``.csv``) are refused with their count
and extension, never skipped: a skipped file is records silently missing from the run.
Hidden (``.``) and underscore names are metadata (``_manifest.json``, locks) and never data.
A folder with a committed manifest (one the pipeline wrote) is JSONL, read by its manifest.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from batch_inference.registry import Registry
from batch_inference.storage import jsonl, parquet, urls
from batch_inference.storage.directory import JsonlDir, natural_key
from batch_inference.storage.errors import UnreadableInputError
from batch_inference.storage.file import JsonlFile
from batch_inference.storage.formats import SourceFormat
from batch_inference.storage.parquet import ParquetSource

DEFAULT = jsonl.SOURCE.name  # a single file no format claims
_FORMATS: Registry[SourceFormat] = Registry("input format", (jsonl.SOURCE, parquet.SOURCE))
PARQUET_SUFFIXES = parquet.SOURCE.suffixes


def register_source(fmt: SourceFormat) -> SourceFormat:
    """Add a stored format (a name already taken is an error: two readers would claim one input)."""
    return _FORMATS.add(fmt)


def unregister_source(name: str) -> None:
    """Remove a format (tests that register one of their own); the built-in ones stay."""
    _FORMATS.remove(name)


def source_formats() -> tuple[SourceFormat, ...]:
    """The registered formats, built-in ones first."""
    return tuple(_FORMATS.values())


def readable() -> str:
    """What the input reads, for messages: ``JSONL (.jsonl, .jsonl.zst) or Parquet (.parquet)``."""
    labels = [f.label for f in _FORMATS.values()]
    return labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + " or " + labels[-1]


READABLE = readable()  # the built-in formats' (callers that name them in a message)


def is_parquet_name(name: str) -> bool:
    return parquet.SOURCE.has_suffix(name)


def format_of_name(name: str) -> str | None:
    """The registered format whose suffix a data file's name has (None: no format's)."""
    return next((f.name for f in _FORMATS.values() if f.reads(name)), None)


def _format_of_file(probe: JsonlFile) -> str:
    """A single file's format: by its name, else by its first bytes, else JSONL."""
    if (by_name := next((f.name for f in _FORMATS.values() if f.has_suffix(probe.name)), None)) is not None:
        return by_name
    with_magic = [f for f in _FORMATS.values() if f.magic]
    if with_magic:
        with probe.fs.open(probe.path, "rb") as fh:
            head = fh.read(max(len(f.magic) for f in with_magic))
        for f in with_magic:
            if head.startswith(f.magic):
                return f.name
    return DEFAULT


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
    """``(format, file URLs in natural order)`` of a folder the readers read whole: a
    registered format's name (an empty folder: ``jsonl``, no files). Raises
    ``UnreadableInputError`` naming the files and folders of no known format, or a mix."""
    fs, path = urls.fs_for(url, storage_options)
    fs.invalidate_cache(path)
    entries = fs.ls(path, detail=True)
    files: dict[str, list[str]] = {name: [] for name in _FORMATS}
    other: list[str] = []
    folders: list[str] = []
    for e in entries:
        name = urls.basename(str(e["name"]))
        if name.startswith((".", "_")) or urls.normalize(str(e["name"])) == urls.normalize(path):
            continue
        if e.get("type") == "directory":
            folders.append(name)
        elif (fmt := format_of_name(name)) is not None:
            files[fmt].append(name)
        else:
            other.append(name)
    known = [k for k in _FORMATS if files[k]]
    if other or folders:
        read = f" beside {len(files[known[0]])} it reads" if known else ""
        raise UnreadableInputError(urls.normalize(url), f"{describe_unread(other, folders)}: not a format this "
                                   f"input reads{read} (a folder is read whole: {readable()} files, no sub-folders)")
    if len(known) > 1:
        raise UnreadableInputError(urls.normalize(url), " and ".join(describe_unread(files[k], []) for k in known)
                                   + ": one folder holds one format")
    fmt = known[0] if known else DEFAULT
    return fmt, [urls.join(urls.normalize(url), n) for n in sorted(files[fmt], key=natural_key)]


def input_format(url: str, storage_options: dict[str, Any] | None = None) -> str:
    """A registered format's name (``jsonl``, ``parquet``): how the input at ``url`` is read
    (raises for a folder of no known format, ``FileNotFoundError`` when nothing is there)."""
    probe = JsonlFile(url, storage_options=storage_options)
    if probe.fs.isdir(probe.path):
        if JsonlDir(url, storage_options=storage_options).manifest() is not None:
            return DEFAULT
        return classify_folder(url, storage_options)[0]
    if not probe.exists_sync():
        raise FileNotFoundError(f"No such file or directory: {probe.url}")
    return _format_of_file(probe)


def open_source(url: str, storage_options: dict[str, Any] | None = None) -> JsonlFile | JsonlDir | ParquetSource:
    """The reader of the input at ``url``: its format's factory (see the module docstring)."""
    fmt = input_format(url, storage_options)
    probe = JsonlFile(url, storage_options=storage_options)
    folder = probe.fs.isdir(probe.path)
    files = classify_folder(url, storage_options)[1] if folder and fmt != DEFAULT else [probe.url]
    return _FORMATS[fmt].open(url, files, folder, storage_options)  # type: ignore[no-any-return]


__all__ = ["PARQUET_SUFFIXES", "READABLE", "SourceFormat", "UnreadableInputError", "classify_folder", "describe_unread",
           "input_format", "is_parquet_name", "open_source", "readable", "register_source", "source_formats"]
