"""The run ledger: per-step figures under ``<run>/ledger/`` and the conservation check.

Each step writes one small JSON object (``shard.json``, ``round-00-infer.json``,
``round-00-judge.json``, ``round-00-decision.json``, ``round-01-recompact.json``,
``tail.json``, ``run.json``); each finished shard task writes a progress record under
``ledger/progress/<step>/part-i.json``, which is what makes a re-run skip it. Writes are
atomic (local: temp file + rename; object stores: one PUT), so a killed driver leaves
either the old object or the new one.

Conservation is checked, not hoped for: :func:`check_conservation` streams every input
id and every terminal row once, hashing ids into on-disk buckets (local temp files),
then checks one bucket at a time that each id's terminal count equals its input count
and that results hold no id more often than the input does. Memory is one bucket
(about ``BUCKET_IDS`` ids), independent of the dataset; disk is ~2x the ids' bytes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from fsspec.asyn import AsyncFileSystem

from batch_inference import rows
from batch_inference.pipeline.counts import Counts
from batch_inference.pipeline.layout import RunLayout
from batch_inference.pipeline.summaries import (
    ConservationReport,
    Decision,
    LedgerView,
    PhaseSummary,
    RecompactSummary,
    ReviewSummary,
    RoundView,
    RunSummary,
    ShardSummary,
    StepProgress,
)
from batch_inference.rows import ErrorKind, Status
from batch_inference.storage import CorruptShardError, JsonlDir, JsonlFile, MalformedRecordError
from batch_inference.storage.urls import fs_for, is_local

log = logging.getLogger(__name__)

S = TypeVar("S")
PROGRESS_NAME = re.compile(r"part-(\d{5,})\.json")  # RunLayout.progress_name's
LIVE_NAME = re.compile(r"part-(\d{5,})\.jsonl")  # RunLayout.live_progress_file's
BUCKET_IDS = 250_000  # input ids per bucket held in memory at once during the check
PROGRESS_READS_IN_FLIGHT = 64  # progress records read at once from an object store (Ledger.progress)
# ``awaiting_review`` is a terminal-state-to-be: records of an open review queue.
TERMINAL_STATES = (*(str(s) for s in rows.TERMINAL_STATES), str(rows.Status.AWAITING_REVIEW))


class ConservationError(RuntimeError):
    """Records were lost, duplicated or double-counted; the message names where."""

    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.details = details or {}


class Ledger:
    """Reads and writes the JSON objects under ``<run>/ledger/``."""

    def __init__(self, layout: RunLayout, storage_options: dict[str, Any] | None = None) -> None:
        self.layout = layout
        self.storage_options = storage_options or {}
        self.fs, _ = fs_for(layout.ledger, self.storage_options)

    def _path(self, url: str) -> str:
        return fs_for(url, self.storage_options)[1]

    def write_url(self, url: str, data: dict[str, Any]) -> None:
        payload = orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
        path = self._path(url)
        if is_local(self.fs):
            parent = os.path.dirname(path)
            os.makedirs(parent, exist_ok=True)
            tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
            try:
                with open(tmp, "wb") as f:
                    f.write(payload)
            except OSError as exc:  # e.g. disk full: name the object, leave no temp file
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise OSError(exc.errno, exc.strerror, path) from exc
            os.replace(tmp, path)
        else:
            self.fs.pipe_file(path, payload)  # one PUT: atomic on object stores

    def read_url(self, url: str) -> dict[str, Any] | None:
        try:
            return orjson.loads(self.fs.cat_file(self._path(url)))
        except FileNotFoundError:
            return None

    def write(self, name: str, data: dict[str, Any]) -> None:
        self.write_url(self.layout.ledger_file(name), data)

    def read(self, name: str) -> dict[str, Any] | None:
        return self.read_url(self.layout.ledger_file(name))

    def write_progress(self, step: str, index: int, data: dict[str, Any]) -> None:
        self.write_url(self.layout.progress_file(step, index), data)

    def read_progress(self, step: str, index: int) -> dict[str, Any] | None:
        return self.read_url(self.layout.progress_file(step, index))

    def progress(self, step: str, indices: list[int] | None) -> dict[int, dict[str, Any]]:
        """Progress records of ``step``'s finished shards among ``indices`` (None: all), by index.

        One listing, then the listed records read together: on an object store
        ``PROGRESS_READS_IN_FLIGHT`` GETs at a time (``fs.cat`` of many paths), since
        read one by one, thousands of shards cost thousands of round trips per phase.
        """
        path = self._path(self.layout.progress_dir(step))
        try:
            self.fs.invalidate_cache(path)
            names = {n.rsplit("/", 1)[-1] for n in self.fs.ls(path, detail=False)}
        except FileNotFoundError:
            return {}
        if indices is None:
            indices = [int(m.group(1)) for n in names if (m := PROGRESS_NAME.fullmatch(n))]
        wanted = {self.fs._strip_protocol(self._path(self.layout.progress_file(step, i))): i
                  for i in indices if self.layout.progress_name(i) in names}
        out: dict[int, dict[str, Any]] = {}
        for key, data in self._cat_many(list(wanted)).items():
            if isinstance(data, FileNotFoundError):  # removed since the listing: not done
                continue
            if isinstance(data, BaseException):
                raise data
            out[wanted[key]] = orjson.loads(data)
        return dict(sorted(out.items()))

    def _cat_many(self, paths: list[str]) -> dict[str, bytes | BaseException]:
        """The bytes of each path (an exception in its place where its read failed)."""
        if not paths:
            return {}
        if isinstance(self.fs, AsyncFileSystem):
            got = self.fs.cat(paths, on_error="return", batch_size=PROGRESS_READS_IN_FLIGHT)
            return {self.fs._strip_protocol(k): v for k, v in got.items()}
        out: dict[str, bytes | BaseException] = {}
        for p in paths:  # local disk, memory://: no round trip to save
            try:
                out[p] = self.fs.cat_file(p)
            except FileNotFoundError as exc:
                out[p] = exc
        return out

    def read_as(self, name: str, kind: type[S]) -> S | None:
        """Ledger entry ``name`` as the summary type it was written from (None if absent)."""
        data = self.read(name)
        return kind.from_dict(data) if data is not None else None  # type: ignore[attr-defined, no-any-return]

    def view(self) -> LedgerView:
        """Everything recorded so far, typed, in round order (for ``batch-inference status``)."""
        names = self.layout
        rounds: list[RoundView] = []
        r = 0
        while True:
            rnd = RoundView(
                round=r, infer=self.read_as(names.step_name(r, "infer"), PhaseSummary),
                judge=self.read_as(names.step_name(r, "judge"), PhaseSummary),
                decision=self.read_as(names.step_name(r, "decision"), Decision),
                recompact=self.read_as(names.step_name(r + 1, "recompact"), RecompactSummary),
                review=self.read_as(names.step_name(r, "review"), ReviewSummary),  # review.ledger_resolved(r)
            )
            if rnd.infer is None and rnd.judge is None and rnd.decision is None:
                break
            rounds.append(rnd)
            r += 1
        return LedgerView(
            spec=self.read(names.SPEC), shard=self.read_as(names.SHARD, ShardSummary), rounds=rounds,
            tail=self.read_as(names.TAIL, PhaseSummary), run=self.read_as(names.RUN, RunSummary),
            steps=self.steps_under_way(),
        )

    def _listed(self, url: str) -> list[str]:
        path = self._path(url)
        try:
            self.fs.invalidate_cache(path)
            return sorted(n.rstrip("/").rsplit("/", 1)[-1] for n in self.fs.ls(path, detail=False))
        except FileNotFoundError:
            return []

    def steps_under_way(self) -> dict[str, StepProgress]:
        """Each step with shard tasks done or running but no ledger entry yet: its finished
        tasks' progress records plus its running tasks' live records (``RunLayout.live_progress_file``;
        a shard with a progress record is counted from that alone)."""
        names = set(self._listed(self.layout.progress_root)) | set(self._listed(self.layout.live_root))
        out: dict[str, StepProgress] = {}
        for step in sorted(names):
            if self.read(step) is not None:  # the step is recorded whole
                continue
            done = self.progress(step, None)
            running_shards = [int(m.group(1)) for n in self._listed(self.layout.live_dir(step))
                              if (m := LIVE_NAME.fullmatch(n)) and int(m.group(1)) not in done]
            paths = [self.fs._strip_protocol(self._path(self.layout.live_progress_file(step, i))) for i in running_shards]
            live: list[dict[str, Any]] = []
            for data in self._cat_many(paths).values():
                if isinstance(data, BaseException):  # gone since the listing (its task finished) or being replaced
                    continue
                try:
                    live.append(orjson.loads(data.splitlines()[0]))
                except (orjson.JSONDecodeError, IndexError):
                    continue
            running = Counts.total(rec.get("counts") or {} for rec in live).as_dict()
            committed = Counts.total(rec.get("counts") or {} for rec in live if rec.get("committed")).as_dict()
            out[step] = StepProgress(
                step=step, shards_done=len(done), shards_running=len(live),
                records_done=sum(int(rec.get("records_in", 0)) for rec in done.values()),
                records_running=sum(int(rec.get("records", 0)) for rec in live),
                done=Counts.total(rec.get("counts") or {} for rec in done.values()).as_dict(), running=running,
                committed=committed)
        return out



# ------------------------------------------------------------------ conservation


@dataclass(frozen=True)
class IdSource:
    """Where ids of one kind live: a JsonlDir, or single files (a quarantined shard)."""

    state: str  # "input" or a terminal state
    urls: tuple[str, ...]
    is_dir: bool = True
    status_field: bool = False  # rows carry "status" (tail unfinished: max_attempts | error)


QUARANTINED_SHARD = "quarantined_shard"  # the failure kind of a record whose whole shard was quarantined


def failure_kind(row: dict[str, Any], in_dir: bool = True) -> str:
    """The kind a failed row failed with (its error's ``ErrorKind`` tag: ``prompt_too_long``,
    ``missing_field``...); a quarantined shard's rows (``in_dir`` False: read from the shard
    itself) carry none: ``quarantined_shard``."""
    if not in_dir:
        return QUARANTINED_SHARD
    text = row.get("reason") or row.get("error")
    kind = ErrorKind.of(text)
    if kind is not None:
        return kind.value
    head = str(text).partition(":")[0].strip()[:40] if text else ""  # an untagged error: its first words
    return head or "unknown"


def _iter_ids(src: IdSource, storage_options: dict[str, Any], unreadable: list[str],
              reasons: Counter[str] | None = None) -> Iterator[tuple[str, str]]:
    """Ids of one source; a shard damaged in storage is read up to the damage and listed in
    ``unreadable``. ``reasons`` counts the failed rows by ``failure_kind``."""
    for url in src.urls:
        if src.is_dir:
            d = JsonlDir(url, storage_options=storage_options)
            if not d.exists_sync():
                continue
            files = d.shards()
        else:
            files = [JsonlFile(url, storage_options=storage_options)]
        for f in files:
            try:
                for rec in f.iter_records_sync():
                    state = src.state
                    if src.status_field:
                        state = Status.MAX_ATTEMPTS if rec.get("status") == Status.MAX_ATTEMPTS else Status.FAILED
                    if state == Status.FAILED and reasons is not None:
                        reasons[failure_kind(rec, src.is_dir)] += 1
                    yield state, str(rec.get("id"))
            except (CorruptShardError, MalformedRecordError) as exc:
                if f.url not in unreadable:
                    unreadable.append(f.url)
                log.error("conservation check: %s", exc)


def _bucket_of(rid: str, n: int) -> int:
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little") % n


def check_conservation(
    sources: list[IdSource], *, input_records: int, storage_options: dict[str, Any] | None = None, examples: int = 10
) -> ConservationReport:
    """Stream ids into hashed buckets on local disk, then check each bucket in memory.

    Never raises for damaged shards (listed in ``unreadable``, which makes ``ok`` false);
    the caller decides how loudly to fail.
    """
    options = storage_options or {}
    n_buckets = max(1, -(-input_records // BUCKET_IDS))
    totals: Counter[str] = Counter()
    reasons: Counter[str] = Counter()  # failed rows by what they failed with, read on the same pass
    missing = extra = dup_results = 0
    bad: list[str] = []
    unreadable: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bi-conservation-") as tmp:
        files = [open(os.path.join(tmp, f"b{i}"), "wb") for i in range(n_buckets)]  # noqa: SIM115
        try:
            for src in sources:
                for state, rid in _iter_ids(src, options, unreadable, reasons):
                    totals[state] += 1
                    files[_bucket_of(rid, n_buckets)].write(orjson.dumps([state, rid]) + b"\n")
        finally:
            for f in files:
                f.close()
        for i in range(n_buckets):
            per_id: dict[str, list[int]] = {}  # id -> [input count, terminal count, results count]
            with open(os.path.join(tmp, f"b{i}"), "rb") as f:
                for line in f:
                    state, rid = orjson.loads(line)
                    c = per_id.setdefault(rid, [0, 0, 0])
                    if state == "input":
                        c[0] += 1
                    else:
                        c[1] += 1
                        c[2] += state == Status.APPROVED
            for rid, (n_in, n_term, n_res) in per_id.items():
                if n_term < n_in:
                    missing += n_in - n_term
                elif n_term > n_in:
                    extra += n_term - n_in
                if n_res > max(n_in, 1):
                    dup_results += n_res - max(n_in, 1)
                if (n_term != n_in or n_res > max(n_in, 1)) and len(bad) < examples:
                    bad.append(f"{rid}: input {n_in}, terminal {n_term}, in results {n_res}")
    terminal = {state: totals.get(state, 0) for state in TERMINAL_STATES}
    ok = missing == 0 and extra == 0 and dup_results == 0 and totals.get("input", 0) == input_records and not unreadable
    return ConservationReport(
        ok=ok, input=totals.get("input", 0), terminal=terminal, missing=missing, extra=extra,
        duplicate_results=dup_results, examples=bad, unreadable=unreadable, failed_reasons=dict(reasons.most_common()),
        method=f"hashed buckets on local disk ({n_buckets} bucket(s), <= ~{BUCKET_IDS} ids in memory each)",
    )
