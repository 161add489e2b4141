"""What a stored input format declares to the input registry (``storage.sources``).

A format is the file names it reads (``suffixes``; ``magic``: a single file's first bytes,
for a file whose name says nothing) and a reader factory. The reader it returns is a
*source*: ``url``, and ``iter_numbered_sync(on_error=..., quarantine=...)`` yielding
``(0-based position, record dict)`` in a stable order, as ``JsonlFile``, ``JsonlDir`` and
``ParquetSource`` do; sharding (``storage.reshard``) reads nothing else of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# (input URL, its data files in natural order (a single file: [its URL]), whether the URL is a
# folder, storage_options) -> the source that reads them.
OpenSource = Callable[[str, list[str], bool, "dict[str, Any] | None"], Any]


@dataclass(frozen=True)
class SourceFormat:
    """One stored input format, as ``storage.sources`` picks it."""

    name: str  # what ``input_format`` returns ("jsonl", "parquet")
    label: str  # how messages name it: "Parquet (.parquet)"
    suffixes: tuple[str, ...]  # file name endings it reads
    open: OpenSource
    magic: bytes = b""  # a file's first bytes (b"PAR1"): a single file named by no format's suffix is read by it
    ignore_case: bool = False  # ``.PARQUET`` too (JSONL shards match exactly: a folder's reader lists them so)

    def has_suffix(self, name: str) -> bool:
        """Whether ``name`` ends in one of this format's suffixes (a single file named as the input)."""
        return (name.lower() if self.ignore_case else name).endswith(self.suffixes)

    def reads(self, name: str) -> bool:
        """Whether a folder's file of this name is this format's data (hidden and ``_`` names never are)."""
        return not name.startswith((".", "_")) and self.has_suffix(name)
