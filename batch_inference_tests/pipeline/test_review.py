"""Human review at the round boundary, in the pipeline layer (no Dagster, no server)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from batch_inference import review as rv
from batch_inference.pipeline import PipelineRun, SpecError, run_pipeline
from batch_inference.pipeline.runner import open_runner
from batch_inference.storage import JsonlDir


def balanced(run: PipelineRun, r: int) -> dict[str, int]:
    """inferred = approved + rejected + awaiting + quarantined, recounted from storage."""
    c = run.round_counts(r)
    assert c["inferred"] == c["approved"] + c["rejected"] + c["awaiting"] + c["judge_quarantined"], c
    assert c["pending"] == c["inferred"] + c["infer_quarantined"], c
    return c


async def judged_round(spec) -> PipelineRun:
    async with open_runner(spec) as runner:
        run = PipelineRun(spec, runner)
        await run.shard()
        await run.infer(0)
        await run.judge(0)
    return PipelineRun(spec)


async def test_human_judge_queues_every_record_and_verdicts_decide_the_round(make_spec) -> None:
    spec = make_spec(records=40, judge={"kind": "human"}, max_rounds=2)
    run = await judged_round(spec)
    assert run.needs_review(0)
    st = run.review_status(0)
    assert (st.awaiting_in, st.decided, st.left, st.resolvable) == (40, 0, 40, False)
    assert st.text == "waiting for review (40 left)"
    assert balanced(run, 0)["awaiting"] == 40
    with pytest.raises(rv.ReviewPending):
        run.decide(0)
    with pytest.raises(rv.ReviewPending):
        await run.resolve_review(0)

    q = rv.ReviewQueue(spec)
    await q.refresh()
    seen = []
    for i in range(40):
        item, lease = await q.claim("alice" if i % 2 else "bob")
        seen.append(item.id)
        verdict = "approve" if i % 4 else "reject"
        edited = "a better answer" if i == 1 else None
        await q.decide(lease.reviewer, item.round, item.id, verdict, reason="wrong" if verdict == "reject" else None,
                       edited_result=edited)
        c = balanced(run, 0)
        assert c["awaiting"] == 40  # open until resolved: still awaiting in storage
    assert len(set(seen)) == 40 and await q.claim("alice") is None
    st = run.review_status(0)
    assert st.left == 0 and st.resolvable and st.by_reviewer == {"alice": 20, "bob": 20}
    summary = await run.resolve_review(0)
    assert (summary.approved, summary.rejected, summary.conflicts, summary.timed_out) == (30, 10, 0, 0)
    c = balanced(run, 0)
    assert (c["approved"], c["rejected"], c["awaiting"]) == (30, 10, 0)
    approved = list(JsonlDir(run.layout.results).iter_records_sync())
    assert {r["review"]["reviewer"] for r in approved} == {"alice", "bob"}
    edited = [r for r in approved if "edited_result" in r["review"]]
    assert len(edited) == 1 and edited[0]["review"]["edited_result"] == "a better answer"
    assert edited[0]["result"] != "a better answer"  # the original stays; the edit is kept beside it
    decision = run.decide(0)
    assert decision.kind == "next_round" and decision.figures["reviewed_rejected"] == 10
    # a verdict after the seal is refused
    with pytest.raises(rv.ReviewClosed):
        await q.decide("alice", 0, seen[0], "approve")


async def test_escalate_sends_only_the_unsure_and_the_run_finishes_with_conservation(make_spec) -> None:
    # The simulated judge approves about half; escalating its rejections makes people decide those.
    spec = make_spec(records=60, approval=0.5, judge={"escalate": {"rejected": True}}, max_rounds=3,
                     review={"poll_s": 0.05})

    async def reviewer() -> int:
        q = rv.ReviewQueue(spec)
        decided = 0
        while True:
            await q.refresh()
            claim = await q.claim("carol")
            if claim is None:
                if q.ledger.read("run") is not None:
                    return decided
                await asyncio.sleep(0.05)
                continue
            item, _ = claim
            await q.decide("carol", item.round, item.id, "approve" if decided % 2 else "reject")
            decided += 1

    task = asyncio.create_task(reviewer())
    summary = await asyncio.wait_for(run_pipeline(spec), 120)
    task.cancel()
    assert summary.conservation["ok"], summary.conservation
    assert summary.approved + summary.exhausted + summary.failed == 60
    run = PipelineRun(spec)
    for r in range(summary.rounds):
        balanced(run, r)
    reviewed = [r for r in JsonlDir(run.layout.results).iter_records_sync() if "review" in r]
    assert reviewed and all(r["review"]["reviewer"] == "carol" for r in reviewed)


async def test_timeout_policy_reject_or_keep_waiting(make_spec, tmp_path) -> None:
    spec = make_spec(records=20, judge={"kind": "human"}, review={"after": "1h", "then": "reject"})
    run = await judged_round(spec)
    q = rv.ReviewQueue(spec)
    await q.refresh()
    item, _ = await q.claim("dave")
    await q.decide("dave", 0, item.id, "approve")
    opened = run.ledger.read(rv.ledger_open(0))["opened_at"]
    assert not run.review_status(0, now=opened + 3599).resolvable
    later = run.review_status(0, now=opened + 3601)
    assert later.due and later.resolvable and later.text.startswith("review timed out")
    summary = await run.resolve_review(0, now=opened + 3601)
    assert (summary.approved, summary.rejected, summary.timed_out) == (1, 19, 19)
    rejected = [r for r in JsonlDir(run.layout.rejected(0)).iter_records_sync()]
    assert all(r["rejection"].startswith("review_timeout") and r["review"]["reviewer"] == rv.TIMEOUT_REVIEWER for r in rejected)
    assert balanced(run, 0)["awaiting"] == 0

    spec2 = make_spec(run="waits", records=20, judge={"kind": "human"}, review={"after": "1h", "then": "keep_waiting"})
    run2 = await judged_round(spec2)
    opened2 = run2.ledger.read(rv.ledger_open(0))["opened_at"]
    st = run2.review_status(0, now=opened2 + 7200)
    assert st.due and not st.resolvable and st.oldest_age_s >= 7200


async def test_first_verdict_stands_conflict_recorded_and_undo(make_spec) -> None:
    t = [1000.0]
    spec = make_spec(records=10, judge={"kind": "human"}, review={"lease": 30})
    run = await judged_round(spec)
    q = rv.ReviewQueue(spec, clock=lambda: t[0])
    await q.refresh()
    a_item, _ = await q.claim("alice")
    b_item, _ = await q.claim("bob")
    assert a_item.id != b_item.id  # never the same record at once
    t[0] += 31  # alice's lease expired: bob may now get her record
    got = []
    while (c := await q.claim("bob", skip=got)) is not None and c[0].id != a_item.id:
        got.append(c[0].id)
    assert c is not None and c[0].id == a_item.id
    first = await q.decide("bob", 0, a_item.id, "reject", reason="nonsense")
    late = await q.decide("alice", 0, a_item.id, "approve")
    assert first.result == "decided" and late.result == "conflict" and late.kept["reviewer"] == "bob"
    # undo: alice retracts her own latest standing verdict, the record comes back to her
    await q.decide("alice", 0, b_item.id, "approve")
    back = await q.undo("alice")
    assert back is not None and back[0].id == b_item.id and back[1].reviewer == "alice"
    assert b_item.id not in q.folds[0].decided
    # a fresh server folds the log the same way
    f = rv.fold(rv.ReviewLog(run.layout, 0, None).entries())
    assert f.decided[a_item.id]["reviewer"] == "bob" and len(f.conflicts) == 1 and f.undone == 1


def test_spec_refuses_a_human_judge_in_place(make_spec) -> None:
    with pytest.raises(SpecError, match="round boundary"):
        make_spec(judge={"kind": "human"}, strategy="in_place")
    with pytest.raises(SpecError, match="escalate"):
        make_spec(judge={"escalate": {}})
    with pytest.raises(SpecError, match="duration"):
        make_spec(judge={"kind": "human"}, review={"after": "soon"})
    assert make_spec(judge={"kind": "human"}, review={"after": "1h30m"}).review.after == 5400.0


async def test_compacting_the_log_keeps_the_fold_and_the_seal(make_spec) -> None:
    spec = make_spec(records=30, judge={"kind": "human"})
    run = await judged_round(spec)
    q = rv.ReviewQueue(spec)
    await q.refresh()
    for i in range(30):
        item, _ = await q.claim("zoe")
        await q.decide("zoe", 0, item.id, "approve" if i % 3 else "reject")
    await q.decide("zoe", 0, item.id, "approve")  # a second verdict on a decided record: a conflict
    log = rv.ReviewLog(run.layout, 0, None)
    before = rv.fold(log.entries())
    assert len(log.segment_names()) == 31
    assert log.compact(min_segments=10) == 31 and len(log.segment_names()) == 1
    after = rv.fold(log.entries())
    assert after.decided == before.decided and after.conflicts == before.conflicts
    # a crash between writing the compacted segment and removing the old ones leaves duplicates: same fold
    log.append(log.entries()[:5])
    assert rv.fold(log.entries()).decided == before.decided
    summary = await run.resolve_review(0)
    assert (summary.approved, summary.rejected, summary.conflicts) == (20, 10, 1)
    assert balanced(run, 0)["awaiting"] == 0


async def test_hybrid_reviews_the_rounds_then_hands_the_rest_to_the_tail(make_spec) -> None:
    spec = make_spec(records=40, approval=0.5, strategy="hybrid", max_rounds=3,
                     crossover={"min_shrink": 0.99, "compare_cost": False}, judge={"escalate": {"rejected": True}},
                     review={"poll_s": 0.05})

    async def reviewer() -> None:
        q = rv.ReviewQueue(spec)
        while True:
            await q.refresh()
            claim = await q.claim("yuki")
            if claim is None:
                await asyncio.sleep(0.05)
                continue
            await q.decide("yuki", claim[0].round, claim[0].id, "reject", reason="not good enough")

    task = asyncio.create_task(reviewer())
    try:
        summary = await asyncio.wait_for(run_pipeline(spec), 120)
    finally:
        task.cancel()
    assert summary.tail and summary.conservation["ok"]
    run = PipelineRun(spec)
    decision = run.decide(0)
    assert decision.kind == "tail" and decision.figures["reviewed_rejected"] == decision.figures["rejected"] > 0
    balanced(run, 0)


async def test_the_status_row_and_the_round_metadata_count_the_reviewers_verdicts(make_spec) -> None:
    """A human-judged round decided by a reviewer: its row in `batch-inference status` and the
    round's figures say 28 approved and 12 rejected, as storage does, not the judge step's 0
    and 0 (the Dagster figures: defs/test_review_sensor.py, defs/test_units.py)."""
    from rich.console import Console

    from batch_inference.pipeline.report import ledger_table

    def row(view) -> list[str]:
        console = Console(width=200, record=True)
        console.print(ledger_table(view, "t"))
        line = next(line for line in console.export_text().splitlines() if "round 0" in line)
        return [c.strip() for c in line.strip("│").split("│")]

    spec = make_spec(records=40, judge={"kind": "human"}, max_rounds=2)
    run = await judged_round(spec)
    waiting = run.ledger.view()
    rnd = waiting.rounds[0]
    assert (rnd.approved, rnd.rejected, rnd.awaiting_review) == (0, 0, 40)
    assert row(waiting)[:5] == ["round 0", "40", "0", "0", "0"] and row(waiting)[-1] == "review"
    q = rv.ReviewQueue(spec)
    await q.refresh()
    for i in range(40):
        item, lease = await q.claim("kim")
        await q.decide(lease.reviewer, item.round, item.id, "approve" if i % 10 < 7 else "reject", reason="no")
    await run.resolve_review(0)
    run.decide(0)
    view = run.ledger.view()
    rnd = view.rounds[0]
    c = balanced(run, 0)
    assert (rnd.approved, rnd.rejected, rnd.awaiting_review) == (c["approved"], c["rejected"], 0) == (28, 12, 0)
    assert rnd.approval == 0.7 and rnd.review is not None and rnd.review.by_reviewer == {"kim": 40}
    cells = row(view)
    assert cells[:5] == ["round 0", "40", "28", "12", "0"] and "70%" in cells[5] and cells[-1] == "next_round", cells


def _skew_server_clock(monkeypatch: pytest.MonkeyPatch, skew_s: float) -> Any:
    """The review server's clock (verdict stamps, segment names, leases) runs ``skew_s`` off the
    resolving process's, as on two machines; returns the server's wall clock."""
    from types import SimpleNamespace

    from batch_inference.review import verdicts

    skewed = SimpleNamespace(time_ns=lambda: time.time_ns() + int(skew_s * 1e9), time=lambda: time.time() + skew_s)
    monkeypatch.setattr(verdicts, "time", skewed)
    return skewed.time


@pytest.mark.parametrize("skew_s", [3600.0, -3600.0])
async def test_a_review_closes_on_its_verdicts_whatever_the_servers_clock(make_spec, monkeypatch, skew_s: float) -> None:
    spec = make_spec(records=6, judge={"kind": "human"})
    run = await judged_round(spec)
    q = rv.ReviewQueue(spec, clock=_skew_server_clock(monkeypatch, skew_s))
    await q.refresh()
    for _ in range(6):
        item, _ = await q.claim("ann")
        await q.decide("ann", 0, item.id, "approve")
    summary = await run.resolve_review(0)  # a server ahead of the resolver: every verdict "in its future"
    assert (summary.approved, summary.rejected, summary.timed_out, summary.by_reviewer) == (6, 0, 0, {"ann": 6})


@pytest.mark.parametrize("skew_s", [3600.0, -3600.0])
@pytest.mark.parametrize("lands", ["before", "after"])
async def test_a_verdict_landing_as_the_round_closes_is_told_whether_it_counted(make_spec, monkeypatch, skew_s: float, lands: str) -> None:
    """The close and the server share the sealed snapshot, not a clock: a verdict in storage
    before the close read the log counts (and says so); one written after is told it does not."""
    spec = make_spec(records=4, judge={"kind": "human"}, review={"after": "1h", "then": "reject"})
    run = await judged_round(spec)
    q = rv.ReviewQueue(spec, clock=_skew_server_clock(monkeypatch, skew_s))
    await q.refresh()
    item, _ = await q.claim("ann")
    written = q._append

    def close() -> None:  # the round's timeout has passed, by the resolver's own clock
        rv.resolve(spec, run.layout, run.ledger, 0, now=time.time() + 7200)

    async def racing_append(r: int, entry: dict[str, Any]) -> Any:
        if lands == "after":
            await asyncio.to_thread(close)
        result = await written(r, entry)
        if lands == "before":
            await asyncio.to_thread(close)
        return result

    q._append = racing_append  # type: ignore[method-assign]
    if lands == "before":
        outcome = await q.decide("ann", 0, item.id, "approve")
        assert outcome.result == "decided"
    else:
        with pytest.raises(rv.ReviewClosed, match="does not count"):
            await q.decide("ann", 0, item.id, "approve")
    summary = await run.resolve_review(0)
    counted = lands == "before"
    assert summary.by_reviewer == ({"ann": 1, rv.TIMEOUT_REVIEWER: 3} if counted else {rv.TIMEOUT_REVIEWER: 4})
    assert summary.approved == (1 if counted else 0)
    with pytest.raises(rv.ReviewClosed):  # and the server takes no verdict after the close
        await q.decide("ann", 0, item.id, "reject")


async def test_a_restarted_server_rebuilds_the_verdict_rate_from_the_log(make_spec) -> None:
    """'Verdicts per hour over the last hour' is the log's, not the server's memory."""
    spec = make_spec(records=8, judge={"kind": "human"}, max_rounds=3)
    await judged_round(spec)
    first = rv.ReviewQueue(spec)
    await first.refresh()
    for _ in range(5):
        item, _ = await first.claim("ann")
        await first.decide("ann", 0, item.id, "approve")
    before = first.progress()
    assert before["rate_per_hour"] == 5 * 60.0 and before["eta_s"] is not None  # 5 verdicts within a minute
    restarted = rv.ReviewQueue(spec)
    await restarted.refresh()
    after = restarted.progress()
    assert (after["done"], after["left"], after["rate_per_hour"]) == (5, 3, before["rate_per_hour"])
    assert after["eta_s"] == before["eta_s"]


async def test_the_verdict_rate_keeps_only_the_last_hour_of_verdicts(make_spec) -> None:
    """A server up for days holds the times of the last hour's verdicts (the rate's window), not every verdict."""
    t = [10_000.0]
    spec = make_spec(records=20, judge={"kind": "human"}, review={"lease": 30})
    await judged_round(spec)
    q = rv.ReviewQueue(spec, clock=lambda: t[0])
    await q.refresh()
    for _ in range(20):  # one verdict every 10 minutes: 3 h 10 min of reviewing
        item, _ = await q.claim("ann")
        await q.decide("ann", 0, item.id, "approve")
        t[0] += 600
    t[0] -= 600  # now: the last verdict's time
    assert len(q.decided_at) == 7  # the verdicts at most an hour old: 0, 10, ..., 60 minutes
    assert q.progress()["rate_per_hour"] == 7.0


async def test_next_picks_up_a_round_opened_since_the_last_refresh(make_spec) -> None:
    """A page asking for work finds a newly opened round at once (the queue looks at storage again when it has none)."""
    spec = make_spec(records=2, judge={"kind": "human"}, max_rounds=3)
    run = await judged_round(spec)
    q = rv.ReviewQueue(spec)
    await q.refresh()
    for _ in range(2):
        item, _ = await q.next("ann")
        await q.decide("ann", 0, item.id, "reject")
    assert await q.next("ann") is None
    await run.resolve_review(0)
    assert run.decide(0).kind == "next_round"
    async with open_runner(spec) as runner:
        nxt = PipelineRun(spec, runner)
        await nxt.recompact(0)
        await nxt.infer(1)
        await nxt.judge(1)
    claim = await q.next("ann")  # no refresh in between: the review server's refresher has not run
    assert claim is not None and claim[0].round == 1 and q.rounds() == [1]
