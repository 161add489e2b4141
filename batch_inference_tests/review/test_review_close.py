"""Closing a round's review while reviewers still act: an undo that lands as the close begins.

The interleavings are forced in one process (a hook between the close's steps), so each
runs the same way every time. Conservation is recounted from storage at the end.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from batch_inference import review as rv
from batch_inference.pipeline import Ledger, PipelineRun
from batch_inference.pipeline.fanout import NullReporter
from batch_inference.review import lifecycle


def balanced(run: PipelineRun, r: int = 0) -> dict[str, int]:
    c = run.round_counts(r)
    assert c["inferred"] == c["approved"] + c["rejected"] + c["awaiting"] + c["judge_quarantined"], c
    return c


def decide_all(q: rv.ReviewQueue, reviewer: str) -> list[rv.Item]:
    async def go() -> list[rv.Item]:
        await q.refresh()
        done = []
        while (claim := await q.claim(reviewer)) is not None:
            item, _ = claim
            await q.decide(reviewer, item.round, item.key, "approve")
            done.append(item)
        return done

    return asyncio.run(go())


def test_an_undo_between_the_status_read_and_the_closing_marker_reopens_the_round(review_spec, monkeypatch) -> None:
    """The close reads status (queue empty); alice's undo lands; then the close marks the round.
    What it read holds the undone record with no verdict: it must not seal, and the round stays
    decidable (today it sealed, then said ReviewPending on every try, forever)."""
    spec, _ = review_spec(records=3)
    run = PipelineRun(spec)
    q = rv.ReviewQueue(spec)
    decided = decide_all(q, "alice")
    assert len(decided) == 3 and run.review_status(0).resolvable
    other = rv.ReviewQueue(spec)  # a second review server: it sees the round closing, then reopened
    asyncio.run(other.refresh())
    undone: list[tuple[rv.Item, rv.Lease] | None] = []
    real_status, real_write = lifecycle.status, run.ledger.write

    def status_then_undo(*args: Any, **kwargs: Any) -> rv.ReviewStatus:
        st = real_status(*args, **kwargs)
        undone.append(asyncio.run(q.undo("alice")))  # the server answers: the record is alice's again
        return st

    def write_then_look(name: str, data: dict[str, Any]) -> None:
        real_write(name, data)
        if name == rv.ledger_closing(0) and not data.get("reopened"):
            asyncio.run(other.refresh())

    monkeypatch.setattr(lifecycle, "status", status_then_undo)
    monkeypatch.setattr(run.ledger, "write", write_then_look)
    with pytest.raises(rv.ReviewPending, match="reopened"):
        rv.resolve(spec, run.layout, run.ledger, 0)
    monkeypatch.undo()
    assert undone and undone[0] is not None
    item, lease = undone[0]
    assert item.key == decided[-1].key and lease.reviewer == "alice"
    assert run.ledger.read(rv.ledger_seal(0)) is None  # checked before it was sealed: nothing sealed
    assert 0 in other.closed and other.rounds() == []
    st = run.review_status(0)
    assert (st.left, st.resolvable) == (1, False) and st.text == "waiting for review (1 left)"
    with pytest.raises(rv.ReviewPending):
        asyncio.run(run.resolve_review(0))
    # the reopened round is served again: by the server that undid, and by the one that saw it closing
    asyncio.run(other.refresh())
    assert other.rounds() == [0] and other.progress()["left"] == 1
    outcome = asyncio.run(q.decide("alice", 0, item.key, "reject", reason="second look"))
    assert outcome.result == "decided"
    summary = asyncio.run(run.resolve_review(0))
    assert (summary.records, summary.approved, summary.rejected, summary.timed_out) == (3, 2, 1, 0)
    assert summary.by_reviewer == {"alice": 3}
    assert balanced(run)["rejected"] == 1


def test_an_undo_that_lands_after_the_close_read_the_log_does_not_count(review_spec, monkeypatch) -> None:
    """The undo passes the open check; the round is closed and sealed before its segment lands.
    The verdict stands, and the reviewer is told so (today the undo answered as if it counted)."""
    spec, _ = review_spec(records=3)
    run = PipelineRun(spec)
    q = rv.ReviewQueue(spec)
    decided = decide_all(q, "bob")
    log = q.logs[0]
    real_append = log.append
    closed: list[rv.ReviewSummary] = []

    def close_then_append(entries: list[dict[str, Any]]) -> None:
        if entries[0]["kind"] == "undo" and not closed:
            closed.append(rv.resolve(spec, run.layout, run.ledger, 0))
        real_append(entries)

    monkeypatch.setattr(log, "append", close_then_append)
    with pytest.raises(rv.ReviewClosed, match="undo of .* does not count"):
        asyncio.run(q.undo("bob"))
    assert closed and closed[0].approved == 3
    assert [e["kind"] for e in log.entries()].count("undo") == 1  # kept in the log, not in the snapshot
    assert decided[-1].key in rv.fold(log.sealed_entries() or []).decided
    assert asyncio.run(run.resolve_review(0)) == closed[0]
    assert balanced(run)["approved"] == 3


def test_the_driver_waits_again_when_its_close_reopens_the_round(review_spec, monkeypatch) -> None:
    """run_pipeline's wait: the close reopens the round (an undo landed before its marker); the
    driver says "waiting for review (1 left)" to its reporter and closes once it is decided."""
    spec, _ = review_spec(records=3, review={"poll_s": 0.05})
    q = rv.ReviewQueue(spec)
    decide_all(q, "alice")
    undone: list[tuple[rv.Item, rv.Lease] | None] = []
    real_write = Ledger.write

    def undo_before_the_marker(self: Ledger, name: str, data: dict[str, Any]) -> None:
        if name == rv.ledger_closing(0) and not data.get("reopened") and not undone:
            undone.append(asyncio.run(q.undo("alice")))
        real_write(self, name, data)

    said: list[tuple[int, str, str]] = []

    class Watch(NullReporter):
        def review_waiting(self, r: int, text: str, url: str) -> None:
            said.append((r, text, url))
            if len(said) == 1:  # a reviewer decides the record the undo handed back
                item, _ = undone[0] or (None, None)
                assert item is not None
                with ThreadPoolExecutor(1) as pool:
                    pool.submit(asyncio.run, q.decide("alice", 0, item.key, "reject", reason="second look")).result()

    monkeypatch.setattr(Ledger, "write", undo_before_the_marker)
    summary = asyncio.run(PipelineRun(spec, reporter=Watch()).wait_for_review(0))
    assert said == [(0, "waiting for review (1 left)", spec.review.url)]
    assert (summary.records, summary.approved, summary.rejected) == (3, 2, 1)
    assert PipelineRun(spec).review_status(0).reopened == 1
