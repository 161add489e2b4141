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
from batch_inference.review.lifecycle import ReviewClosed, closing, keyed_rows, ledger_seal, opened
from batch_inference.review.verdicts import COMPACT_EVERY, Fold, ReviewLog, VerdictKind, fold, undo_entry, verdict_entry
from batch_inference.storage import JsonlDir

_round = round  # the ``round=`` keyword of the queue's methods shadows it there
RATE_WINDOW_S = 3600.0  # progress's rate: verdicts per hour over the last hour


@dataclass
class Item:
    """One record in an open review queue: ``id`` is the record's, ``key`` names its row in the
    round (the id, or ``id#2``... where the input repeats an id: each row is decided)."""

    round: int
    id: str
    row: dict[str, Any]
    key: str = ""

    def __post_init__(self) -> None:
        self.key = self.key or self.id

    @property
    def reason(self) -> str:
        verdict = self.row.get("verdict") or {}
        return str(verdict.get("reason") or "")


@dataclass
class Lease:
    key: str  # the queue row's (Item.key)
    round: int
    reviewer: str
    token: str
    expires_at: float

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "round": self.round, "reviewer": self.reviewer, "token": self.token, "expires_at": self.expires_at}


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
        self.items: dict[int, dict[str, Item]] = {}  # round -> key -> item, queue order
        self.logs: dict[int, ReviewLog] = {}
        self.folds: dict[int, Fold] = {}
        self.leases: dict[tuple[int, str], Lease] = {}  # (round, key)
        self.history: dict[tuple[int, str], list[dict[str, Any]]] = {}  # (round, record id)
        # times of the run's verdicts within the rate's window (the log's, then this server's), oldest first
        self.decided_at: deque[float] = deque()
        self.closed: set[int] = set()
        self.counted: set[int] = set()  # rounds whose stored verdicts are in decided_at
        self.appended: dict[int, int] = {}  # segments this server wrote per round since its last compaction
        self._lock = asyncio.Lock()

    # -- loading ------------------------------------------------------------------
    async def refresh(self) -> None:
        """Pick up rounds whose review opened (or closed) since the last look."""
        await asyncio.to_thread(self._refresh)

    def _refresh(self) -> None:
        r = 0
        while self.ledger.read(RunLayout.step_name(r, "infer")) is not None or r in self.items:
            if r not in self.items and opened(self.ledger, r) is not None:
                if closing(self.ledger, r):
                    if r not in self.closed:
                        self.closed.add(r)
                        self._count_verdicts(r, ReviewLog(self.layout, r, self.opts).entries())
                else:  # not yet seen, or reopened by a close that found an undo in what it read
                    self.closed.discard(r)
                    self._load_round(r)
            elif r in self.items and closing(self.ledger, r):
                self.closed.add(r)
                del self.items[r]
            r += 1

    def _load_round(self, r: int) -> None:
        items = {key: Item(r, str(row["id"]), row, key) for key, _, row in keyed_rows(self.layout, r, self.opts)}
        log = ReviewLog(self.layout, r, self.opts)
        entries = log.entries()
        f = fold(entries)
        self._count_verdicts(r, entries)
        now = self.clock()
        for key, lease in log.leases().items():
            if float(lease["expires_at"]) > now and key in items and key not in f.decided:
                self.leases[(r, key)] = Lease(key, r, str(lease["reviewer"]), str(lease["token"]), float(lease["expires_at"]))
        self.history.update(self._earlier_attempts(r, {it.id for it in items.values()}))
        self.logs[r], self.folds[r], self.items[r] = log, f, items

    def _count_verdicts(self, r: int, entries: list[dict[str, Any]]) -> None:
        """Verdicts already in a round's log, for the rate over the last hour: a restarted
        server goes on from what is stored, not from zero (once per round: a reopened round's
        verdicts are counted already)."""
        if r in self.counted:
            return
        self.counted.add(r)
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
        return (it for key, it in self.items[r].items() if key not in f.decided)

    def _held_by_other(self, r: int, key: str, reviewer: str, now: float) -> bool:
        lease = self.leases.get((r, key))
        return lease is not None and lease.expires_at > now and lease.reviewer != reviewer

    async def claim(self, reviewer: str, *, round: int | None = None, reason: str | None = None,
                    skip: Iterable[str] = ()) -> tuple[Item, Lease] | None:
        """Lease the next undecided record no one else holds (this reviewer's own lease first); ``skip``: keys."""
        skipped = set(skip)
        async with self._lock:
            now = self.clock()
            for r in self.rounds():
                if round is not None and r != round:
                    continue
                for it in self._undecided(r):
                    lease = self.leases.get((r, it.key))
                    if lease is not None and lease.reviewer == reviewer and lease.expires_at > now and it.key not in skipped:
                        return it, lease
            for r in self.rounds():
                if round is not None and r != round:
                    continue
                for it in self._undecided(r):
                    if it.key in skipped or (reason and it.reason != reason) or self._held_by_other(r, it.key, reviewer, now):
                        continue
                    lease = Lease(it.key, r, reviewer, uuid.uuid4().hex, now + self.lease_s)
                    await asyncio.to_thread(self.logs[r].put_lease, lease.as_dict())
                    self.leases[(r, it.key)] = lease
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

    async def release(self, reviewer: str, r: int, key: str) -> None:
        """Give a record back (skip): others may take it at once."""
        async with self._lock:
            lease = self.leases.get((r, key))
            if lease is not None and lease.reviewer == reviewer:
                del self.leases[(r, key)]
                await asyncio.to_thread(self.logs[r].drop_lease, key)

    def _check_open(self, r: int) -> None:
        if r not in self.items:
            raise ReviewClosed(f"round {r} of run {self.spec.run!r} has no open review queue")
        if closing(self.ledger, r):
            self.closed.add(r)
            self.items.pop(r, None)
            raise ReviewClosed(f"round {r} of run {self.spec.run!r}: the review was closed; verdicts are no longer taken")

    def _counted(self, r: int, entry_id: str) -> bool | None:
        """Whether an entry (verdict or undo) this server just wrote counts. While the round is
        not closing, yes: the close marks it closing before it reads the log, so it reads this
        write. Once it is closing, the sealed snapshot says; a close that reopens the round
        instead (it found an undo in what it read) will read this write on its next try, so it
        counts (None: neither within ``SEAL_WAIT_S``)."""
        deadline = time.monotonic() + self.SEAL_WAIT_S
        while closing(self.ledger, r):
            if self.ledger.read(ledger_seal(r)) is not None:
                return any(str(e.get("entry")) == entry_id for e in self.logs[r].sealed_entries() or [])
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)
        return True

    async def _commit(self, r: int, entry: dict[str, Any], what: str) -> None:
        """Write ``entry`` to round ``r``'s log (open rounds only) and learn whether it counts:
        the one path of a verdict and of an undo, so neither can slip past a closing round.
        Raises :class:`ReviewClosed` when the round is closed, or closed as the entry landed."""
        await asyncio.to_thread(self._check_open, r)
        await self._append(r, entry)
        counted = await asyncio.to_thread(self._counted, r, str(entry["entry"]))
        if counted is not True:
            # The round closed as this entry was being written: it is in the log, and the close
            # decided without it (or has not said yet). Say so rather than claim it counted.
            self.closed.add(r)
            self.items.pop(r, None)
            why = "does not count" if counted is False else "may not count (the close has not finished)"
            raise ReviewClosed(f"round {r} of run {self.spec.run!r}: the review closed as your {what} landed; "
                               f"it is kept in the log but {why}")

    async def decide(self, reviewer: str, r: int, key: str, verdict: VerdictKind, *, reason: str | None = None,
                     edited_result: str | None = None) -> Outcome:
        """Append the verdict on the row ``key`` to the log (durable before this returns); the first verdict stands."""
        async with self._lock:
            item = self.items.get(r, {}).get(key)
            if item is None and r in self.items:
                raise KeyError(f"record {key!r} is not in round {r}'s review queue")
            rid = item.id if item is not None else key  # (no open round: _commit refuses it)
            entry = verdict_entry(rid, verdict, reviewer, reason=reason, edited_result=edited_result, round=r, key=key)
            await self._commit(r, entry, f"verdict on {key!r}")
            kept = self.folds[r].decided.get(key)
            result = self.folds[r].add(entry)
            self._decided(self.clock())
            if self.leases.pop((r, key), None) is not None:
                await asyncio.to_thread(self.logs[r].drop_lease, key)
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
        """Retract this reviewer's latest standing verdict in an open round; the record comes back, leased to them.

        Raises :class:`ReviewClosed` when the round closed as the undo landed (the verdict stands).
        """
        async with self._lock:
            latest: dict[str, Any] | None = None
            for r in self.rounds():
                for e in self.folds[r].decided.values():
                    if e.get("reviewer") == reviewer and (latest is None or int(e["at_ns"]) > int(latest["at_ns"])):
                        latest = e
            if latest is None:
                return None
            r = int(latest["round"])
            entry = undo_entry(latest, reviewer)
            key = str(entry["key"])
            await self._commit(r, entry, f"undo of {key!r}")
            self.folds[r].add(entry)
            lease = Lease(key, r, reviewer, uuid.uuid4().hex, self.clock() + self.lease_s)
            await asyncio.to_thread(self.logs[r].put_lease, lease.as_dict())
            self.leases[(r, key)] = lease
            return self.items[r][key], lease

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
            "round": item.round, "id": item.id, "key": item.key, "prompt": row.get("prompt"), "messages": row.get("messages"),
            "result": row.get("result"), "verdict": row.get("verdict"), "attempts": row.get("attempts"),
            "earlier": self.history.get((item.round, item.id), []),
            "record": {k: v for k, v in row.items() if k not in ("prompt", "messages", "result", "verdict", "status")},
            "lease": {"token": lease.token, "expires_at": lease.expires_at, "reviewer": lease.reviewer},
        }
