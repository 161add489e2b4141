"""The live review queues of one run, as a review server serves them (claim, decide, release, undo)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from batch_inference.pipeline.layout import RunLayout
from batch_inference.pipeline.ledger import Ledger
from batch_inference.pipeline.spec import PipelineSpec
from batch_inference.review.lifecycle import ReviewClosed, closing, ledger_seal, opened, queue_rows
from batch_inference.review.verdicts import COMPACT_EVERY, Fold, ReviewLog, VerdictKind, fold, undo_entry, verdict_entry
from batch_inference.storage import JsonlDir

_round = round  # the ``round=`` keyword of the queue's methods shadows it there
RATE_WINDOW_S = 3600.0  # progress's rate: verdicts per hour over the last hour


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

    SEAL_WAIT_S = 10.0  # how long a verdict that landed as the round was closing waits to learn whether it counted

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
        # times of the run's verdicts within the rate's window (the log's, then this server's), oldest first
        self.decided_at: deque[float] = deque()
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
                if closing(self.ledger, r):
                    self.closed.add(r)
                    self._count_verdicts(ReviewLog(self.layout, r, self.opts).entries())
                else:
                    self._load_round(r)
            elif r in self.items and closing(self.ledger, r):
                self.closed.add(r)
                del self.items[r]
            r += 1

    def _load_round(self, r: int) -> None:
        items = {str(row["id"]): Item(r, str(row["id"]), row) for _, row in queue_rows(self.layout, r, self.opts)}
        log = ReviewLog(self.layout, r, self.opts)
        entries = log.entries()
        f = fold(entries)
        self._count_verdicts(entries)
        now = self.clock()
        for rid, lease in log.leases().items():
            if float(lease["expires_at"]) > now and rid in items and rid not in f.decided:
                self.leases[(r, rid)] = Lease(rid, r, str(lease["reviewer"]), str(lease["token"]), float(lease["expires_at"]))
        self.history.update(self._earlier_attempts(r, set(items)))
        self.logs[r], self.folds[r], self.items[r] = log, f, items

    def _count_verdicts(self, entries: list[dict[str, Any]]) -> None:
        """Verdicts already in a round's log, for the rate over the last hour: a restarted
        server goes on from what is stored, not from zero."""
        now = self.clock()
        stored = (int(e.get("at_ns", 0)) / 1e9 for e in entries if e.get("kind") == "verdict")
        self.decided_at = deque(sorted([*self.decided_at, *(t for t in stored if now - t <= RATE_WINDOW_S)]))

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

    async def next(self, reviewer: str, *, round: int | None = None, reason: str | None = None,
                   skip: Iterable[str] = ()) -> tuple[Item, Lease] | None:
        """``claim``, looking at storage again when nothing is here: a round may have opened since the last refresh."""
        skipped = list(skip)
        claim = await self.claim(reviewer, round=round, reason=reason, skip=skipped)
        if claim is None:
            await self.refresh()
            claim = await self.claim(reviewer, round=round, reason=reason, skip=skipped)
        return claim

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
        if closing(self.ledger, r):
            self.closed.add(r)
            self.items.pop(r, None)
            raise ReviewClosed(f"round {r} of run {self.spec.run!r}: the review was closed; verdicts are no longer taken")

    def _counted(self, r: int, entry_id: str) -> bool | None:
        """Whether a verdict this server just wrote counts. While the round is not closing, yes:
        the close marks it closing before it reads the log, so it reads this write. Once it is
        closing, the sealed snapshot says (None: no seal within ``SEAL_WAIT_S``)."""
        if not closing(self.ledger, r):
            return True
        deadline = time.monotonic() + self.SEAL_WAIT_S
        while self.ledger.read(ledger_seal(r)) is None:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)
        return any(str(e.get("entry")) == entry_id for e in self.logs[r].sealed_entries() or [])

    async def decide(self, reviewer: str, r: int, rid: str, verdict: VerdictKind, *, reason: str | None = None,
                     edited_result: str | None = None) -> Outcome:
        """Append the verdict to the log (durable before this returns); the first verdict stands."""
        async with self._lock:
            await asyncio.to_thread(self._check_open, r)
            if rid not in self.items[r]:
                raise KeyError(f"record {rid!r} is not in round {r}'s review queue")
            entry = verdict_entry(rid, verdict, reviewer, reason=reason, edited_result=edited_result, round=r)
            await self._append(r, entry)
            counted = await asyncio.to_thread(self._counted, r, str(entry["entry"]))
            if counted is not True:
                # The round closed as this verdict was being written: it is in the log, and the
                # close decided without it (or has not said yet). Say so rather than claim it counted.
                self.closed.add(r)
                self.items.pop(r, None)
                why = "does not count" if counted is False else "may not count (the close has not finished)"
                raise ReviewClosed(f"round {r} of run {self.spec.run!r}: the review closed as your verdict on {rid!r} "
                                   f"landed; it is kept in the log but {why}")
            kept = self.folds[r].decided.get(rid)
            result = self.folds[r].add(entry)
            self._decided(self.clock())
            if self.leases.pop((r, rid), None) is not None:
                await asyncio.to_thread(self.logs[r].drop_lease, rid)
            return Outcome(result, entry, kept if result == "conflict" else None)

    def _decided(self, now: float) -> None:
        """Count a verdict for the rate; times that have left its window are dropped, so a
        long-running server holds an hour of them, not the run's."""
        self.decided_at.append(now)
        while self.decided_at and now - self.decided_at[0] > RATE_WINDOW_S:
            self.decided_at.popleft()

    async def _append(self, r: int, entry: dict[str, Any]) -> None:
        """Durable before it returns; every ``COMPACT_EVERY`` segments the log is folded into one."""
        await asyncio.to_thread(self.logs[r].append, [entry])
        self.appended[r] = self.appended.get(r, 0) + 1
        if self.appended[r] >= COMPACT_EVERY:
            self.appended[r] = 0
            await asyncio.to_thread(self.logs[r].compact)

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
        window = [t for t in self.decided_at if now - t <= RATE_WINDOW_S]
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
