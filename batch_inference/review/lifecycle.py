"""A round's review from the pipeline's side: open the queue, read its status, resolve it.

A round whose judge escalates to people (``judge.escalate``) or is human
(``judge.kind: human``) writes the records people must decide to
``round-NN/review/queue/`` (``status: awaiting_review``, automated verdict beside).
The round's automated part is then finished; the queue is a state of the round.

:func:`resolve` closes a round's review: it marks the round closing (a review server
takes no verdict after that), snapshots the log (the entries it decides on, which a
server reads to tell a reviewer whether a verdict that landed meanwhile counted: no
clock of either machine is compared), applies the timeout policy to what is still waiting, and writes
approved rows into ``results/round-NN-review-part-i`` and rejected rows beside the
judge's in ``round-NN/rejected/review-part-i``, so the next round, the tail and the
checks read them like any other. What it read is checked before it is sealed: a record an
undo handed back meanwhile reopens the round instead.

:class:`ReviewGate` is this module as the pipeline's ``RoundGate`` (``pipeline.gate``): the
composition roots (CLI, Dagster steps, API) hand it to ``PipelineRun``.

Every queue row is decided on its own, named by its key (:func:`review_keys`): an input
may repeat an id.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from batch_inference.pipeline.gate import (  # the names the pipeline shares with its gate (re-exported)
    AWAITING_REVIEW,
    ReviewClosed,
    ReviewPending,
    ReviewStatus,
    ReviewSummary,
    closing,
    ledger_closing,
    ledger_open,
    ledger_resolved,
    ledger_seal,
    opened,
)
from batch_inference.pipeline.layout import RunLayout
from batch_inference.pipeline.ledger import Ledger
from batch_inference.pipeline.spec import PipelineSpec
from batch_inference.review.verdicts import Fold, ReviewLog, fold
from batch_inference.storage import JsonlDir, JsonlFile

TIMEOUT_REVIEWER = "timeout-policy"


def _policy_text(spec: PipelineSpec) -> str:
    p = spec.review
    return "wait for people" if p.after is None else f"after {p.after:g}s: {p.then}"


def status(spec: PipelineSpec, layout: RunLayout, ledger: Ledger, r: int, *, now: float | None = None) -> ReviewStatus:
    """The round's review state from the ledger and the verdict log (blocking)."""
    now = time.time() if now is None else now
    info = opened(ledger, r)
    if info is None:
        raise ReviewPending(f"run {spec.run!r} round {r}: no review queue was opened (judge({r}) sent nobody to review)")
    total = int(info["records"])
    opened_at = float(info["opened_at"])
    reopened = int((ledger.read(ledger_closing(r)) or {}).get("reopens", 0))
    done = ledger.read(ledger_resolved(r))
    if done is not None:
        return ReviewStatus(r, total, total, 0, int(done["approved"]), int(done["rejected"]), dict(done["by_reviewer"]),
                            int(done["conflicts"]), opened_at, 0.0, _policy_text(spec), False, False, True, reopened)
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
                        resolvable, False, reopened)


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


def review_keys(ids: list[str]) -> list[str]:
    """A key per queue row, unique in the round, in queue order: the record's id, or
    ``id#2``, ``id#3``... for a later row with the same id (an input may repeat an id, and
    each row is decided). A suffix another row's id already holds is skipped, so keys never
    collide; the queue is written once, so its order, and every key, is stable."""
    taken = set(ids)
    seen: set[str] = set()
    keys = []
    for rid in ids:
        key, n = rid, 1
        while key in seen or (n > 1 and key in taken):
            n += 1
            key = f"{rid}#{n}"
        seen.add(key)
        keys.append(key)
    return keys


def keyed_rows(layout: RunLayout, r: int, storage_options: dict[str, Any] | None) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """(review key, judge shard index, row) of every record in round ``r``'s review queue:
    a verdict, a lease and the fold name a row by its key (:func:`review_keys`)."""
    keys = review_keys([str(row.get("id")) for _, row in queue_rows(layout, r, storage_options)])
    for key, (index, row) in zip(keys, queue_rows(layout, r, storage_options), strict=True):
        yield key, index, row


def _undecided(f: Fold, layout: RunLayout, r: int, opts: dict[str, Any] | None, policy: str | None) -> list[str]:
    """Keys of the queue's rows that neither a verdict in ``f`` nor ``policy`` decides."""
    if policy in ("approve", "reject"):
        return []
    return [key for key, _, _ in keyed_rows(layout, r, opts) if key not in f.decided]


def resolve(spec: PipelineSpec, layout: RunLayout, ledger: Ledger, r: int, *, now: float | None = None) -> ReviewSummary:
    """Close round ``r``'s review (blocking, idempotent): seal, apply the policy, write the outcome.

    Raises :class:`ReviewPending` while records wait and the policy does not decide them,
    also when an undo landed as the close began: what the close read is checked before it
    is sealed, and a round it cannot decide is reopened, never sealed.
    """
    if (done := ledger.read(ledger_resolved(r))) is not None:
        return ReviewSummary.from_dict(done)
    t0 = time.perf_counter()
    opts = spec.storage_options or None
    log = ReviewLog(layout, r, opts)
    seal = ledger.read(ledger_seal(r))
    if seal is None:
        marked = ledger.read(ledger_closing(r))
        if marked is None or marked.get("reopened"):
            st = status(spec, layout, ledger, r, now=now)
            if not st.resolvable:
                raise ReviewPending(f"run {spec.run!r} round {r}: {st.text}")
            marked = {"round": r, "at": time.time() if now is None else now, "due": st.due, "reopens": st.reopened}
            ledger.write(ledger_closing(r), marked)
        # Read after the marker: every verdict (or undo) whose write finished before a server
        # saw the marker is in the log now, and no server writes one after seeing it. The
        # snapshot, not a segment list or a time: a server may compact the log, and clocks differ.
        segments = len(log.segment_names())
        entries = log.entries()
        undecided = _undecided(fold(entries), layout, r, opts, spec.review.then if marked["due"] else None)
        if undecided:
            # An undo landed between the status read and the marker: the server told its
            # reviewer the record is theirs again, so the close must not decide without it.
            ledger.write(ledger_closing(r), {"round": r, "reopened": True, "reopens": int(marked.get("reopens", 0)) + 1,
                                             "at": time.time(), "undecided": undecided[:50]})
            raise ReviewPending(f"run {spec.run!r} round {r}: the review was reopened as it closed: {len(undecided)} record(s) "
                                f"undone meanwhile wait again (e.g. {undecided[0]!r})")
        log.write_sealed(entries)
        seal = {"round": r, "at": float(marked["at"]), "entries": len(entries), "segments": segments, "due": marked["due"]}
        ledger.write(ledger_seal(r), seal)
    sealed = log.sealed_entries()
    if sealed is None:
        raise ReviewClosed(f"run {spec.run!r} round {r}: the review is sealed but its snapshot {log.sealed_url} is missing")
    f = fold(sealed)
    policy = spec.review.then if seal["due"] else None
    by_index: dict[int, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}
    by_reviewer: Counter[str] = Counter()
    by_verdict: Counter[str] = Counter()
    timed_out = records = 0
    for key, index, row in keyed_rows(layout, r, opts):
        records += 1
        yes, no = by_index.setdefault(index, ([], []))
        e = f.decided.get(key)
        if e is None:
            if policy not in ("approve", "reject"):  # checked before the seal: cannot happen unless edited
                raise ReviewClosed(f"run {spec.run!r} round {r}: record {row.get('id')!r} has no verdict in the sealed "
                                   f"snapshot and no policy decides it")
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


class ReviewGate:
    """Human review over the verdict log as the pipeline's round gate (``pipeline.gate.RoundGate``)."""

    def open(self, spec: PipelineSpec, layout: RunLayout, ledger: Ledger, r: int, records: int) -> None:
        open_queue(ledger, r, records)

    def status(self, spec: PipelineSpec, layout: RunLayout, ledger: Ledger, r: int, *,
               now: float | None = None) -> ReviewStatus:
        return status(spec, layout, ledger, r, now=now)

    def resolve(self, spec: PipelineSpec, layout: RunLayout, ledger: Ledger, r: int, *,
                now: float | None = None) -> ReviewSummary:
        return resolve(spec, layout, ledger, r, now=now)


__all__ = ["AWAITING_REVIEW", "TIMEOUT_REVIEWER", "ReviewClosed", "ReviewGate", "ReviewPending", "ReviewStatus",
           "ReviewSummary", "closing", "keyed_rows", "ledger_closing", "ledger_open", "ledger_resolved", "ledger_seal",
           "open_queue", "opened", "queue_rows", "resolve", "review_keys", "status"]
