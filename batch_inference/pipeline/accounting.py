"""The one rule for input lines that are not plain records: malformed lines and duplicate ids.

Every step that reads the input or reports on it (``validate``, ``plan``, the shard step
of ``run``, ``status``, both exports) counts and names them through ``InputAccount``, so a
user can account for every line of the input from the first check to the export:

- a **malformed line** (bad JSON, bad UTF-8, not a JSON object) is never a crash: it is
  counted, named by ``file:line`` (1-based), left out of the run (quarantined at sharding,
  ``RunLayout.input_quarantine``), and the exports account for it (an error line in the
  OpenAI Batch error file, a ``failed`` row in Parquet);
- a **duplicate id** is kept: each occurrence is a record of its own and gets its own answer
  (nothing is merged or dropped), so the id appears once per occurrence in the results and
  the export; every step says so, naming the ids.

``lines = records + malformed``: blank lines are not counted (they hold nothing).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from batch_inference.storage import JsonlFile

EXAMPLES = 5  # lines or ids a note names before "..."
# Ids a check holds in memory to find repeats (~100 MB at most): past them the check stops and
# says so. The shard step checks every id (a fixed-size Bloom filter, ``storage.reshard``).
ID_CHECK_LIMIT = 1_000_000


def line_name(entry: Mapping[str, Any]) -> str:
    """How a malformed line is named everywhere: ``file:line`` (1-based, as an editor counts)."""
    return f"{entry['file']}:{entry['line']}"


@dataclass
class InputAccount:
    """What became of the input's lines: records, malformed lines (left out), duplicate ids (kept)."""

    records: int = 0
    malformed: int = 0
    malformed_at: list[str] = field(default_factory=list)  # ``file:line`` of the first few
    duplicate_ids: int = 0  # distinct ids seen more than once
    duplicate_examples: list[str] = field(default_factory=list)  # the first few such ids
    quarantine: str | None = None  # where the malformed lines are kept (a run's), if anywhere
    repeats: dict[str, int] = field(default_factory=dict, repr=False)  # id -> occurrences (>1), when counted here
    ids_checked: int | None = None  # records whose ids were checked for repeats, when fewer than all

    @property
    def lines(self) -> int:
        """The input's lines that hold something: records plus malformed lines."""
        return self.records + self.malformed

    # -- counting (a reader's quarantine sink, and the ids it reads) ---------------------

    def count_malformed(self, entry: Mapping[str, Any]) -> None:
        """One malformed line: the sink ``iter_numbered_sync(on_error="quarantine", ...)`` calls."""
        self.malformed += 1
        if len(self.malformed_at) < EXAMPLES:
            self.malformed_at.append(line_name(entry))

    def counting(self, numbered: Iterable[tuple[int, dict[str, Any]]], *, id_of: Any = None,
                 max_ids: int | None = ID_CHECK_LIMIT) -> Iterator[tuple[int, dict[str, Any]]]:
        """``numbered`` passed through, each record counted and its id (``id_of(rec, line)``,
        default the record's own ``id``; a record without one gets a unique one) checked for
        repeats. The ids are held in memory, so only the first ``max_ids`` records' are
        checked (None: all); ``notes`` says when the check stopped short."""
        seen: set[str] = set()
        repeats: dict[str, int] = {}
        for line, rec in numbered:
            self.records += 1
            rid = id_of(rec, line) if id_of is not None else rec.get("id")
            if max_ids is not None and self.records > max_ids:
                self.ids_checked = max_ids
            elif rid is not None:
                key = str(rid)
                if key in seen:
                    repeats[key] = repeats.get(key, 1) + 1
                seen.add(key)
            yield line, rec
        self.repeats = repeats
        self.duplicate_ids = len(repeats)
        self.duplicate_examples = list(repeats)[:EXAMPLES]

    # -- from what the shard step recorded ---------------------------------------------

    @classmethod
    def of_shard(cls, shard: Any, quarantine: str | None = None) -> InputAccount:
        """The account the shard step recorded (``ShardSummary``)."""
        return cls(records=shard.records, malformed=shard.malformed, malformed_at=list(shard.malformed_examples),
                   duplicate_ids=shard.duplicate_ids, duplicate_examples=list(shard.duplicate_examples)[:EXAMPLES],
                   quarantine=quarantine if shard.malformed else None)

    # -- what every step says ----------------------------------------------------------

    def summary(self) -> str:
        """``2,000 line(s): 1,997 record(s), 3 malformed (left out)``."""
        text = f"{self.lines:,} line(s): {self.records:,} record(s)"
        return text + (f", {self.malformed:,} malformed (left out)" if self.malformed else "")

    def notes(self) -> list[str]:
        """One warning per kind of line that is not a plain record; empty when there is none."""
        out = []
        if self.malformed:
            named = ", ".join(self.malformed_at) + (", ..." if self.malformed > len(self.malformed_at) else "")
            where = f"; kept in {self.quarantine}" if self.quarantine else ""
            out.append(f"{self.malformed:,} malformed line(s) (not a JSON object, or a record without its id) left out of the run: {named}{where}")
        if self.duplicate_ids:
            named = ", ".join(repr(x) for x in self.duplicate_examples) + (", ..." if self.duplicate_ids > len(self.duplicate_examples) else "")
            out.append(f"{self.duplicate_ids:,} id(s) appear more than once in the input: {named}; each occurrence is "
                       "kept as a record of its own, so the id appears once per occurrence in the results and the export")
        if self.ids_checked is not None:
            out.append(f"ids checked for repeats over the first {self.ids_checked:,} record(s) only (of {self.records:,}); "
                       "the run's shard step checks every id")
        return out


def id_lines(files: Iterable[Any], ids: set[str], id_of: Any, limit: int = EXAMPLES) -> dict[str, list[str]]:
    """``file:line`` (1-based) of up to ``limit`` occurrences of each of ``ids`` in ``files``
    (JsonlFile readers, in order; ``id_of(rec, line)`` a record's id): a second pass, made
    only to name the lines of a refused file's duplicate ids."""
    found: dict[str, list[str]] = {}
    for f in files:
        for line, rec in f.iter_numbered_sync(on_error="quarantine", quarantine=lambda entry: None):
            rid = str(id_of(rec, line))
            if rid in ids and len(found.setdefault(rid, [])) < limit:
                found[rid].append(line_name({"file": f.url, "line": line + 1}))
    return found


def quarantined_lines(url: str, storage_options: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """The malformed lines a run's shard step kept (``{file, line, reason, raw}`` each)."""
    f = JsonlFile(url, storage_options=storage_options)
    if f.exists_sync():
        yield from f.iter_records_sync()


def malformed_message(entry: Mapping[str, Any]) -> str:
    """The error an export gives a malformed line: it names the line and why it is not a record."""
    return f"malformed_line: {line_name(entry)}: {entry.get('reason') or 'not a JSON object'} (left out of the run)"


__all__ = ["InputAccount", "id_lines", "line_name", "malformed_message", "quarantined_lines"]
