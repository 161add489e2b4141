"""A round's verdict log: append-only segments, leases, and the fold that reads them.

Verdicts are append-only: each write is one small segment under
``round-NN/review/verdicts/`` through the storage layer's atomic writer, holding
entries ``{entry, kind: verdict|undo, id, verdict, reason, edited_result, reviewer,
at_ns}``. Nothing is ever rewritten, so a crash loses at most a verdict being typed.
:func:`fold` reads the log in time order: a record's first verdict stands; a later
verdict on a decided record is kept in the log and reported as a conflict; an ``undo``
by the same reviewer retracts their verdict while the round is still open.

Closing a round snapshots the log into ``round-NN/review/sealed.jsonl.zst``: the close
decides on exactly those entries, and a server asks the snapshot (not a clock) whether a
verdict it wrote counted.

Leases (``round-NN/review/leases/<hash>.json``) make sure two reviewers are never
shown the same record at once; they expire, so a reviewer who walks away (or a review
server that dies) holds nothing for longer than ``review.lease``.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from batch_inference.pipeline.layout import RunLayout
from batch_inference.storage import JsonlFile
from batch_inference.storage.urls import fs_for, join

COMPACT_EVERY = 200  # verdict segments a review server lets pile up before folding them into one
VerdictKind = Literal["approve", "reject"]


def _lease_name(key: str) -> str:
    return hashlib.blake2b(key.encode(), digest_size=12).hexdigest() + ".json"



class ReviewLog:
    """One round's verdict log and leases in storage (blocking I/O: call off the event loop)."""

    def __init__(self, layout: RunLayout, r: int, storage_options: dict[str, Any] | None = None) -> None:
        self.layout, self.round = layout, r
        self.storage_options = storage_options or None
        self.url = layout.verdicts(r)
        self.fs, self.path = fs_for(self.url, self.storage_options)
        self.lease_url = layout.leases(r)
        _, self.lease_path = fs_for(self.lease_url, self.storage_options)
        self.sealed_url = join(layout.review_dir(r), "sealed.jsonl.zst")

    def append(self, entries: list[dict[str, Any]]) -> None:
        """Write ``entries`` as one new segment (atomic)."""
        name = f"{time.time_ns():020d}-{uuid.uuid4().hex[:12]}.jsonl"
        with JsonlFile(join(self.url, name), storage_options=self.storage_options).writer_sync() as w:
            w.write_many(entries)

    def segment_names(self) -> list[str]:
        try:
            self.fs.invalidate_cache(self.path)
            names = [n.rsplit("/", 1)[-1] for n in self.fs.ls(self.path, detail=False)]
        except FileNotFoundError:
            return []
        return sorted(n for n in names if n.endswith(".jsonl") and not n.startswith((".", "_")))

    def entries(self, names: Iterable[str] | None = None) -> list[dict[str, Any]]:
        """Every entry (of ``names``, default all segments), deduplicated, in time order.

        A segment folded away by a concurrent :meth:`compact` meanwhile is in the compacted
        segment, written before it was removed: the listing is read again.
        """
        for attempt in range(5):
            seen: dict[str, dict[str, Any]] = {}
            try:
                for name in self.segment_names() if names is None else names:
                    for e in JsonlFile(join(self.url, name), storage_options=self.storage_options).iter_records_sync():
                        seen.setdefault(str(e.get("entry")), e)
            except FileNotFoundError:
                if names is not None or attempt == 4:
                    raise
                continue
            return sorted(seen.values(), key=lambda e: (int(e.get("at_ns", 0)), str(e.get("entry"))))
        raise AssertionError("unreachable")

    def compact(self, *, min_segments: int = COMPACT_EVERY) -> int:
        """Fold the log's segments into one (written first, then the folded ones removed); returns how many.

        Entries keep their ids and times, so a crash between the two steps leaves
        duplicates that :meth:`entries` drops, and the fold reads the same either way.
        """
        names = self.segment_names()
        if len(names) < min_segments:
            return 0
        entries = self.entries(names)
        name = f"{time.time_ns():020d}-compact-{uuid.uuid4().hex[:12]}.jsonl"
        with JsonlFile(join(self.url, name), storage_options=self.storage_options).writer_sync() as w:
            w.write_many(entries)
        self.fs.rm([f"{self.path}/{n}" for n in names])
        return len(names)

    # -- the seal's snapshot ----------------------------------------------------------
    def write_sealed(self, entries: list[dict[str, Any]]) -> None:
        """The entries a close decides on (atomic; rewritten only before the seal is recorded)."""
        with JsonlFile(self.sealed_url, storage_options=self.storage_options).writer_sync() as w:
            w.write_many(entries)

    def sealed_entries(self) -> list[dict[str, Any]] | None:
        """The sealed snapshot's entries, in the log's order; None before it is written."""
        f = JsonlFile(self.sealed_url, storage_options=self.storage_options)
        return list(f.iter_records_sync()) if f.exists_sync() else None

    # -- leases -------------------------------------------------------------------
    def put_lease(self, lease: dict[str, Any]) -> None:
        path = f"{self.lease_path}/{_lease_name(str(lease['key']))}"
        self.fs.makedirs(self.lease_path, exist_ok=True)
        self.fs.pipe_file(path, orjson.dumps(lease))

    def drop_lease(self, key: str) -> None:
        path = f"{self.lease_path}/{_lease_name(key)}"
        try:
            self.fs.rm(path)
        except FileNotFoundError:
            pass

    def leases(self) -> dict[str, dict[str, Any]]:
        """The stored leases by the queue row's key (a lease written before keys names it ``id``)."""
        try:
            self.fs.invalidate_cache(self.lease_path)
            paths = self.fs.ls(self.lease_path, detail=False)
        except FileNotFoundError:
            return {}
        out: dict[str, dict[str, Any]] = {}
        for p in paths:
            try:
                lease = orjson.loads(self.fs.cat_file(p))
            except (FileNotFoundError, orjson.JSONDecodeError):
                continue  # dropped meanwhile, or a torn write of a local temp: no lease
            out[str(lease.get("key") or lease["id"])] = lease
        return out


@dataclass
class Fold:
    """A round's log read in time order: the verdict that stands per record, and the rest."""

    decided: dict[str, dict[str, Any]] = field(default_factory=dict)
    conflicts: list[dict[str, Any]] = field(default_factory=list)  # {id, kept, other}
    undone: int = 0

    def add(self, e: dict[str, Any]) -> str:
        """Apply one entry; returns ``decided``, ``conflict``, ``undone`` or ``ignored``."""
        rid = entry_key(e)
        if e.get("kind") == "undo":
            kept = self.decided.get(rid)
            if kept is not None and kept.get("entry") == e.get("target") and kept.get("reviewer") == e.get("reviewer"):
                del self.decided[rid]
                self.undone += 1
                return "undone"
            return "ignored"
        kept = self.decided.get(rid)
        if kept is None:
            self.decided[rid] = e
            return "decided"
        self.conflicts.append({"id": rid, "kept": _brief(kept), "other": _brief(e)})
        return "conflict"


def _brief(e: dict[str, Any]) -> dict[str, Any]:
    return {k: e.get(k) for k in ("entry", "reviewer", "verdict", "reason", "at_ns")}


def entry_key(e: dict[str, Any]) -> str:
    """The queue row an entry decides: its ``key`` (``lifecycle.review_keys``), or its ``id``
    where the two are the same (every row whose id is not repeated; logs written before keys)."""
    return str(e.get("key") or e.get("id"))


def fold(entries: Iterable[dict[str, Any]]) -> Fold:
    f = Fold()
    for e in entries:
        f.add(e)
    return f


def verdict_entry(rid: str, verdict: VerdictKind, reviewer: str, *, reason: str | None = None,
                  edited_result: str | None = None, round: int, at_ns: int | None = None, key: str | None = None) -> dict[str, Any]:
    """A verdict on record ``rid``; ``key`` names its queue row where the id is repeated."""
    if verdict not in ("approve", "reject"):
        raise ValueError(f"record {rid!r}: verdict must be 'approve' or 'reject', got {verdict!r}")
    return {"entry": uuid.uuid4().hex, "kind": "verdict", "id": rid, "key": key or rid, "round": round, "verdict": verdict,
            "reason": reason or None, "edited_result": edited_result, "reviewer": reviewer,
            "at_ns": at_ns if at_ns is not None else time.time_ns()}


def undo_entry(kept: dict[str, Any], reviewer: str) -> dict[str, Any]:
    return {"entry": uuid.uuid4().hex, "kind": "undo", "id": kept["id"], "key": entry_key(kept), "round": kept.get("round"),
            "target": kept["entry"], "reviewer": reviewer, "at_ns": time.time_ns()}
