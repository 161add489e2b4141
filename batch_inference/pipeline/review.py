"""Human review at the round boundary: the queue, the durable verdict log, leases.

A round whose judge escalates to people (``judge.escalate``) or is human
(``judge.kind: human``) writes the records people must decide to
``round-NN/review/queue/`` (``status: awaiting_review``, automated verdict beside).
The round's automated part is then finished; the queue is a state of the round.

Verdicts are append-only: each write is one small segment under
``round-NN/review/verdicts/`` through the storage layer's atomic writer, holding
entries ``{entry, kind: verdict|undo, id, verdict, reason, edited_result, reviewer,
at_ns}``. Nothing is ever rewritten, so a crash loses at most a verdict being typed.
:func:`fold` reads the log in time order: a record's first verdict stands; a later
verdict on a decided record is kept in the log and reported as a conflict; an ``undo``
by the same reviewer retracts their verdict while the round is still open.

Leases (``round-NN/review/leases/<hash>.json``) make sure two reviewers are never
shown the same record at once; they expire, so a reviewer who walks away (or a review
server that dies) holds nothing for longer than ``review.lease``.

:func:`resolve` closes a round's review: it seals the log (the segments it decides
on, and the time), applies the timeout policy to what is still waiting, and writes
approved rows into ``results/round-NN-review-part-i`` and rejected rows beside the
judge's in ``round-NN/rejected/review-part-i``, so the next round, the tail and the
checks read them like any other.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from batch_inference import rows
from batch_inference.pipeline.layout import RunLayout
from batch_inference.pipeline.ledger import Ledger
from batch_inference.pipeline.spec import PipelineSpec
from batch_inference.pipeline.summaries import _Summary
from batch_inference.storage import JsonlDir, JsonlFile
from batch_inference.storage.urls import fs_for, join

COMPACT_EVERY = 200  # verdict segments a review server lets pile up before folding them into one
_round = round  # the ``round=`` keyword of the queue's methods shadows it there
AWAITING_REVIEW = rows.Status.AWAITING_REVIEW.value
TIMEOUT_REVIEWER = "timeout-policy"
VerdictKind = Literal["approve", "reject"]


class ReviewPending(RuntimeError):
    """The round's review queue is not empty (and its timeout policy does not decide it yet)."""


class ReviewClosed(RuntimeError):
    """The round's review is sealed: no verdict can change it any more."""


def ledger_open(r: int) -> str:
    return RunLayout.step_name(r, "review-open")


def ledger_seal(r: int) -> str:
    return RunLayout.step_name(r, "review-seal")


def ledger_resolved(r: int) -> str:
    return RunLayout.step_name(r, "review")


def _lease_name(rid: str) -> str:
    return hashlib.blake2b(rid.encode(), digest_size=12).hexdigest() + ".json"


# ------------------------------------------------------------------------ the log


class ReviewLog:
    """One round's verdict log and leases in storage (blocking I/O: call off the event loop)."""

    def __init__(self, layout: RunLayout, r: int, storage_options: dict[str, Any] | None = None) -> None:
        self.layout, self.round = layout, r
        self.storage_options = storage_options or None
        self.url = layout.verdicts(r)
        self.fs, self.path = fs_for(self.url, self.storage_options)
        self.lease_url = layout.leases(r)
        _, self.lease_path = fs_for(self.lease_url, self.storage_options)

    def append(self, entries: list[dict[str, Any]]) -> int:
        """Write ``entries`` as one new segment (atomic); returns when it was committed (ns)."""
        name = f"{time.time_ns():020d}-{uuid.uuid4().hex[:12]}.jsonl"
        with JsonlFile(join(self.url, name), storage_options=self.storage_options).writer_sync() as w:
            w.write_many(entries)
        return time.time_ns()

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

    # -- leases -------------------------------------------------------------------
    def put_lease(self, lease: dict[str, Any]) -> None:
        path = f"{self.lease_path}/{_lease_name(str(lease['id']))}"
        self.fs.makedirs(self.lease_path, exist_ok=True)
        self.fs.pipe_file(path, orjson.dumps(lease))

    def drop_lease(self, rid: str) -> None:
        path = f"{self.lease_path}/{_lease_name(rid)}"
        try:
            self.fs.rm(path)
        except FileNotFoundError:
            pass

    def leases(self) -> dict[str, dict[str, Any]]:
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
            out[str(lease["id"])] = lease
        return out


@dataclass
class Fold:
    """A round's log read in time order: the verdict that stands per record, and the rest."""

    decided: dict[str, dict[str, Any]] = field(default_factory=dict)
    conflicts: list[dict[str, Any]] = field(default_factory=list)  # {id, kept, other}
    undone: int = 0

    def add(self, e: dict[str, Any]) -> str:
        """Apply one entry; returns ``decided``, ``conflict``, ``undone`` or ``ignored``."""
        rid = str(e.get("id"))
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


def fold(entries: Iterable[dict[str, Any]]) -> Fold:
    f = Fold()
    for e in entries:
        f.add(e)
    return f


def verdict_entry(rid: str, verdict: VerdictKind, reviewer: str, *, reason: str | None = None,
                  edited_result: str | None = None, round: int, at_ns: int | None = None) -> dict[str, Any]:
    if verdict not in ("approve", "reject"):
        raise ValueError(f"record {rid!r}: verdict must be 'approve' or 'reject', got {verdict!r}")
    return {"entry": uuid.uuid4().hex, "kind": "verdict", "id": rid, "round": round, "verdict": verdict,
            "reason": reason or None, "edited_result": edited_result, "reviewer": reviewer,
            "at_ns": at_ns if at_ns is not None else time.time_ns()}


def undo_entry(kept: dict[str, Any], reviewer: str) -> dict[str, Any]:
    return {"entry": uuid.uuid4().hex, "kind": "undo", "id": kept["id"], "round": kept.get("round"),
            "target": kept["entry"], "reviewer": reviewer, "at_ns": time.time_ns()}


# ------------------------------------------------------------------ status, resolve


@dataclass(frozen=True)
class ReviewStatus(_Summary):
    """Where a round's review stands (cheap enough for a sensor tick: the log, not the queue)."""

    round: int
    awaiting_in: int  # records the judge sent to people
    decided: int
    left: int
    approved: int
    rejected: int
    by_reviewer: dict[str, int]
    conflicts: int
    opened_at: float
    oldest_age_s: float  # of the oldest record still waiting (0 when none waits)
    policy: str  # e.g. "after 172800s: reject", "wait for people"
    due: bool  # the timeout has passed and the policy decides the rest
    resolvable: bool  # resolve() would close the round now
    resolved: bool

    @property
    def text(self) -> str:
        if self.resolved:
            return "review finished"
        if self.left == 0:
            return "review queue empty"
        if self.due:
            return f"review timed out: {self.policy} ({self.left} left)"
        return f"waiting for review ({self.left} left)"


@dataclass(frozen=True)
class ReviewSummary(_Summary):
    """A closed review: what people and the timeout policy decided."""

    round: int
    records: int
    approved: int
    rejected: int
    by_reviewer: dict[str, int]
    by_verdict: dict[str, int]
    timed_out: int  # decided by the timeout policy
    conflicts: int
    conflict_examples: list[dict[str, Any]]
    segments: int
    sealed_at: float
    wall_s: float


def _policy_text(spec: PipelineSpec) -> str:
    p = spec.review
    return "wait for people" if p.after is None else f"after {p.after:g}s: {p.then}"


def opened(ledger: Ledger, r: int) -> dict[str, Any] | None:
    return ledger.read(ledger_open(r))


def status(spec: PipelineSpec, layout: RunLayout, ledger: Ledger, r: int, *, now: float | None = None) -> ReviewStatus:
    """The round's review state from the ledger and the verdict log (blocking)."""
    now = time.time() if now is None else now
    info = opened(ledger, r)
    if info is None:
        raise ReviewPending(f"run {spec.run!r} round {r}: no review queue was opened (judge({r}) sent nobody to review)")
    total = int(info["records"])
    opened_at = float(info["opened_at"])
    done = ledger.read(ledger_resolved(r))
    if done is not None:
        return ReviewStatus(r, total, total, 0, int(done["approved"]), int(done["rejected"]), dict(done["by_reviewer"]),
                            int(done["conflicts"]), opened_at, 0.0, _policy_text(spec), False, False, True)
    f = fold(ReviewLog(layout, r, spec.storage_options).entries())
    decided = len(f.decided)
    left = max(0, total - decided)
    verdicts = Counter(e["verdict"] for e in f.decided.values())
    by_reviewer = Counter(str(e["reviewer"]) for e in f.decided.values())
    p = spec.review
    due = left > 0 and p.after is not None and now - opened_at >= p.after
    resolvable = left == 0 or (due and p.then != "keep_waiting")
    return ReviewStatus(r, total, decided, left, verdicts.get("approve", 0), verdicts.get("reject", 0), dict(by_reviewer),
                        len(f.conflicts), opened_at, (now - opened_at) if left else 0.0, _policy_text(spec), due,
                        resolvable, False)


def open_queue(ledger: Ledger, r: int, records: int) -> None:
    """Mark round ``r``'s review queue open (the judge's last act); keeps the first opening time."""
    if ledger.read(ledger_open(r)) is None:
        ledger.write(ledger_open(r), {"round": r, "records": records, "opened_at": time.time()})


def queue_rows(layout: RunLayout, r: int, storage_options: dict[str, Any] | None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(judge shard index, row) of every record in round ``r``'s review queue."""
    d = JsonlDir(layout.review_queue(r), storage_options=storage_options)
    if not d.exists_sync():
        return
    for f in d.shards():
        index = int(f.name.split("-")[1].split(".")[0])
        for row in f.iter_records_sync():
            yield index, row


def resolve(spec: PipelineSpec, layout: RunLayout, ledger: Ledger, r: int, *, now: float | None = None) -> ReviewSummary:
    """Close round ``r``'s review (blocking, idempotent): seal, apply the policy, write the outcome.

    Raises :class:`ReviewPending` while records wait and the policy does not decide them.
    """
    if (done := ledger.read(ledger_resolved(r))) is not None:
        return ReviewSummary.from_dict(done)
    t0 = time.perf_counter()
    opts = spec.storage_options or None
    log = ReviewLog(layout, r, opts)
    seal = ledger.read(ledger_seal(r))
    if seal is None:
        st = status(spec, layout, ledger, r, now=now)
        if not st.resolvable:
            raise ReviewPending(f"run {spec.run!r} round {r}: {st.text}")
        # The cut-off, not a segment list: a server may compact the log after the seal.
        seal = {"round": r, "at": time.time() if now is None else now, "cutoff_ns": time.time_ns(),
                "segments": len(log.segment_names()), "due": st.due}
        ledger.write(ledger_seal(r), seal)
    f = fold(e for e in log.entries() if int(e.get("at_ns", 0)) <= int(seal["cutoff_ns"]))
    policy = spec.review.then if seal["due"] else None
    by_index: dict[int, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}
    by_reviewer: Counter[str] = Counter()
    by_verdict: Counter[str] = Counter()
    timed_out = records = 0
    for index, row in queue_rows(layout, r, opts):
        records += 1
        yes, no = by_index.setdefault(index, ([], []))
        e = f.decided.get(str(row.get("id")))
        if e is None:
            if policy not in ("approve", "reject"):  # sealed on an empty queue: cannot happen unless edited
                raise ReviewPending(f"run {spec.run!r} round {r}: record {row.get('id')!r} has no verdict and no policy decides it")
            timed_out += 1
            e = {"verdict": policy, "reviewer": TIMEOUT_REVIEWER, "reason": f"review timed out after {spec.review.after:g}s",
                 "at_ns": int(float(seal["at"]) * 1e9), "entry": None, "edited_result": None}
        review = {"verdict": e["verdict"], "reviewer": e["reviewer"], "reason": e.get("reason"), "at_ns": e.get("at_ns"),
                  "entry": e.get("entry")}
        if e.get("edited_result") is not None:
            review["edited_result"] = e["edited_result"]
        by_reviewer[str(e["reviewer"])] += 1
        by_verdict[str(e["verdict"])] += 1
        if e["verdict"] == "approve":
            yes.append({**row, "status": "approved", "review": review, "round": r})
        else:
            reason = e.get("reason") or "rejected"
            no.append({**{k: v for k, v in row.items() if k != "status"}, "review": review,
                       "rejection": f"review_timeout: {reason}" if e["reviewer"] == TIMEOUT_REVIEWER else f"human: {reason}"})
    for index, (yes, no) in sorted(by_index.items()):
        for url, out in ((layout.reviewed_approved_shard(r, index), yes), (layout.reviewed_rejected_shard(r, index), no)):
            with JsonlFile(url, storage_options=opts).writer_sync() as w:
                w.write_many(out)
    summary = ReviewSummary(
        round=r, records=records, approved=by_verdict.get("approve", 0), rejected=by_verdict.get("reject", 0),
        by_reviewer=dict(by_reviewer), by_verdict=dict(by_verdict), timed_out=timed_out, conflicts=len(f.conflicts),
        conflict_examples=f.conflicts[:50], segments=int(seal["segments"]), sealed_at=float(seal["at"]),
        wall_s=time.perf_counter() - t0,
    )
    ledger.write(ledger_resolved(r), summary.as_dict())
    return summary


# ------------------------------------------------------------- the live queue (server)


@dataclass
class Item:
    """One record in an open review queue."""

    round: int
    id: str
    row: dict[str, Any]

    @property
    def reason(self) -> str:
        verdict = self.row.get("verdict") or {}
        return str(verdict.get("reason") or "")


@dataclass
class Lease:
    id: str
    round: int
    reviewer: str
    token: str
    expires_at: float

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "round": self.round, "reviewer": self.reviewer, "token": self.token, "expires_at": self.expires_at}


@dataclass
class Outcome:
    """What a submitted verdict did: ``decided``, ``conflict`` (kept in the log, not applied)."""

    result: str
    entry: dict[str, Any]
    kept: dict[str, Any] | None = None


class ReviewQueue:
    """The open review queues of one run, for a review server (asyncio; one per run).

    State that matters lives in storage (queue shards, verdict log, leases); memory
    holds the queue rows of open rounds (one review's worth), the fold, and a lock that
    makes claiming atomic within this server. Every write goes through
    ``asyncio.to_thread``.
    """

    def __init__(self, spec: PipelineSpec, *, lease_s: float | None = None, clock: Any = time.time) -> None:
        self.spec = spec
        self.layout = RunLayout(spec.output, spec.run)
        self.ledger = Ledger(self.layout, spec.storage_options)
        self.opts = spec.storage_options or None
        self.lease_s = float(lease_s if lease_s is not None else spec.review.lease)
        self.clock = clock
        self.items: dict[int, dict[str, Item]] = {}  # round -> id -> item, queue order
        self.logs: dict[int, ReviewLog] = {}
        self.folds: dict[int, Fold] = {}
        self.leases: dict[tuple[int, str], Lease] = {}
        self.history: dict[tuple[int, str], list[dict[str, Any]]] = {}
        self.decided_at: list[tuple[float, str]] = []  # (time, reviewer) of verdicts seen by this server
        self.closed: set[int] = set()
        self.appended: dict[int, int] = {}  # segments this server wrote per round since its last compaction
        self._lock = asyncio.Lock()

    # -- loading ------------------------------------------------------------------
    async def refresh(self) -> None:
        """Pick up rounds whose review opened (or closed) since the last look."""
        await asyncio.to_thread(self._refresh)

    def _refresh(self) -> None:
        r = 0
        while self.ledger.read(RunLayout.step_name(r, "infer")) is not None or r in self.items:
            if r not in self.items and r not in self.closed and opened(self.ledger, r) is not None:
                if self.ledger.read(ledger_seal(r)) is not None:
                    self.closed.add(r)
                else:
                    self._load_round(r)
            elif r in self.items and self.ledger.read(ledger_seal(r)) is not None:
                self.closed.add(r)
                del self.items[r]
            r += 1

    def _load_round(self, r: int) -> None:
        items = {str(row["id"]): Item(r, str(row["id"]), row) for _, row in queue_rows(self.layout, r, self.opts)}
        log = ReviewLog(self.layout, r, self.opts)
        f = fold(log.entries())
        now = self.clock()
        for rid, lease in log.leases().items():
            if float(lease["expires_at"]) > now and rid in items and rid not in f.decided:
                self.leases[(r, rid)] = Lease(rid, r, str(lease["reviewer"]), str(lease["token"]), float(lease["expires_at"]))
        self.history.update(self._earlier_attempts(r, set(items)))
        self.logs[r], self.folds[r], self.items[r] = log, f, items

    def _earlier_attempts(self, r: int, ids: set[str]) -> dict[tuple[int, str], list[dict[str, Any]]]:
        """Each queued record's rows in the rejected sets of earlier rounds (one scan per round)."""
        out: dict[tuple[int, str], list[dict[str, Any]]] = {}
        for k in range(r):
            d = JsonlDir(self.layout.rejected(k), storage_options=self.opts)
            if not d.exists_sync():
                continue
            for f in d.shards():
                for row in f.iter_records_sync():
                    rid = str(row.get("id"))
                    if rid in ids:
                        out.setdefault((r, rid), []).append(
                            {"round": k, "result": row.get("result"), "error": row.get("error"),
                             "rejection": row.get("rejection"), "verdict": row.get("verdict"), "review": row.get("review")})
        return out

    # -- reviewing ----------------------------------------------------------------
    def rounds(self) -> list[int]:
        return sorted(self.items)

    def _undecided(self, r: int) -> Iterator[Item]:
        f = self.folds[r]
        return (it for rid, it in self.items[r].items() if rid not in f.decided)

    def _held_by_other(self, r: int, rid: str, reviewer: str, now: float) -> bool:
        lease = self.leases.get((r, rid))
        return lease is not None and lease.expires_at > now and lease.reviewer != reviewer

    async def claim(self, reviewer: str, *, round: int | None = None, reason: str | None = None,
                    skip: Iterable[str] = ()) -> tuple[Item, Lease] | None:
        """Lease the next undecided record no one else holds (this reviewer's own lease first)."""
        skipped = set(skip)
        async with self._lock:
            now = self.clock()
            for r in self.rounds():
                if round is not None and r != round:
                    continue
                for it in self._undecided(r):
                    lease = self.leases.get((r, it.id))
                    if lease is not None and lease.reviewer == reviewer and lease.expires_at > now and it.id not in skipped:
                        return it, lease
            for r in self.rounds():
                if round is not None and r != round:
                    continue
                for it in self._undecided(r):
                    if it.id in skipped or (reason and it.reason != reason) or self._held_by_other(r, it.id, reviewer, now):
                        continue
                    lease = Lease(it.id, r, reviewer, uuid.uuid4().hex, now + self.lease_s)
                    await asyncio.to_thread(self.logs[r].put_lease, lease.as_dict())
                    self.leases[(r, it.id)] = lease
                    return it, lease
        return None

    async def release(self, reviewer: str, r: int, rid: str) -> None:
        """Give a record back (skip): others may take it at once."""
        async with self._lock:
            lease = self.leases.get((r, rid))
            if lease is not None and lease.reviewer == reviewer:
                del self.leases[(r, rid)]
                await asyncio.to_thread(self.logs[r].drop_lease, rid)

    def _check_open(self, r: int) -> None:
        if r not in self.items:
            raise ReviewClosed(f"round {r} of run {self.spec.run!r} has no open review queue")
        if self.ledger.read(ledger_seal(r)) is not None:
            self.closed.add(r)
            self.items.pop(r, None)
            raise ReviewClosed(f"round {r} of run {self.spec.run!r}: the review was closed; verdicts are no longer taken")

    async def decide(self, reviewer: str, r: int, rid: str, verdict: VerdictKind, *, reason: str | None = None,
                     edited_result: str | None = None) -> Outcome:
        """Append the verdict to the log (durable before this returns); the first verdict stands."""
        async with self._lock:
            await asyncio.to_thread(self._check_open, r)
            if rid not in self.items[r]:
                raise KeyError(f"record {rid!r} is not in round {r}'s review queue")
            entry = verdict_entry(rid, verdict, reviewer, reason=reason, edited_result=edited_result, round=r)
            written_ns = await self._append(r, entry)
            seal = await asyncio.to_thread(self.ledger.read, ledger_seal(r))
            if seal is not None and int(seal.get("cutoff_ns", 0)) <= written_ns:
                # The round closed while this verdict was being written: it is in the log, but the
                # close may have been decided without it. Say so rather than claim it counted.
                # (A seal cut after the write read the log after it: the verdict counted.)
                self.closed.add(r)
                self.items.pop(r, None)
                raise ReviewClosed(f"round {r} of run {self.spec.run!r}: the review closed as your verdict on {rid!r} "
                                   "landed; it is kept in the log but may not count")
            kept = self.folds[r].decided.get(rid)
            result = self.folds[r].add(entry)
            self.decided_at.append((self.clock(), reviewer))
            if self.leases.pop((r, rid), None) is not None:
                await asyncio.to_thread(self.logs[r].drop_lease, rid)
            return Outcome(result, entry, kept if result == "conflict" else None)

    async def _append(self, r: int, entry: dict[str, Any]) -> int:
        """Durable before it returns (the commit time, ns); every ``COMPACT_EVERY`` segments the log is folded into one."""
        committed_ns = await asyncio.to_thread(self.logs[r].append, [entry])
        self.appended[r] = self.appended.get(r, 0) + 1
        if self.appended[r] >= COMPACT_EVERY:
            self.appended[r] = 0
            await asyncio.to_thread(self.logs[r].compact)
        return committed_ns

    async def undo(self, reviewer: str) -> tuple[Item, Lease] | None:
        """Retract this reviewer's latest standing verdict in an open round; the record comes back, leased to them."""
        async with self._lock:
            latest: dict[str, Any] | None = None
            for r in self.rounds():
                for e in self.folds[r].decided.values():
                    if e.get("reviewer") == reviewer and (latest is None or int(e["at_ns"]) > int(latest["at_ns"])):
                        latest = e
            if latest is None:
                return None
            r, rid = int(latest["round"]), str(latest["id"])
            await asyncio.to_thread(self._check_open, r)
            entry = undo_entry(latest, reviewer)
            await self._append(r, entry)
            self.folds[r].add(entry)
            lease = Lease(rid, r, reviewer, uuid.uuid4().hex, self.clock() + self.lease_s)
            await asyncio.to_thread(self.logs[r].put_lease, lease.as_dict())
            self.leases[(r, rid)] = lease
            return self.items[r][rid], lease

    # -- progress -----------------------------------------------------------------
    def progress(self, *, round: int | None = None, reason: str | None = None) -> dict[str, Any]:
        """Done, left, per reviewer, rate (verdicts/hour over the last hour) and ETA."""
        now = self.clock()
        done = left = 0
        per_reviewer: Counter[str] = Counter()
        verdicts: Counter[str] = Counter()
        reasons: Counter[str] = Counter()
        rounds = []
        for r in self.rounds():
            f = self.folds[r]
            n_left = sum(1 for _ in self._undecided(r))
            rounds.append({"round": r, "total": len(self.items[r]), "done": len(f.decided), "left": n_left,
                           "conflicts": len(f.conflicts)})
            for it in self._undecided(r):
                reasons[it.reason] += 1
            if round is not None and r != round:
                continue
            for e in f.decided.values():
                per_reviewer[str(e["reviewer"])] += 1
                verdicts[str(e["verdict"])] += 1
            done += len(f.decided)
            left += n_left if not reason else sum(1 for it in self._undecided(r) if it.reason == reason)
        window = [t for t, _ in self.decided_at if now - t <= 3600.0]
        span = max(60.0, now - min(window)) if window else 0.0
        rate_per_h = len(window) * 3600.0 / span if window else 0.0
        return {"done": done, "left": left, "per_reviewer": dict(per_reviewer), "verdicts": dict(verdicts),
                "rate_per_hour": _round(rate_per_h, 1), "eta_s": _round(left / rate_per_h * 3600.0) if rate_per_h and left else None,
                "rounds": rounds, "reasons": dict(reasons)}

    def view(self, item: Item, lease: Lease) -> dict[str, Any]:
        """What the page shows for one record (plain JSON: the page renders it as text)."""
        row = item.row
        return {
            "round": item.round, "id": item.id, "prompt": row.get("prompt"), "messages": row.get("messages"),
            "result": row.get("result"), "verdict": row.get("verdict"), "attempts": row.get("attempts"),
            "earlier": self.history.get((item.round, item.id), []),
            "record": {k: v for k, v in row.items() if k not in ("prompt", "messages", "result", "verdict", "status")},
            "lease": {"token": lease.token, "expires_at": lease.expires_at, "reviewer": lease.reviewer},
        }
