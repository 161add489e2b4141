"""The round sensor waits on a round's review queue while verdicts trickle in (real sensor, ephemeral instance)."""

from __future__ import annotations

import asyncio

import dagster as dg
import pytest

from batch_inference import review as rv
from batch_inference.defs.driver import drive, start_run, tick
from batch_inference.defs.keys import REJECTED, RESULTS, REVIEWED
from batch_inference.defs.runs.jobs import start_run_config
from batch_inference.pipeline import Ledger, PipelineRun, PipelineSpec
from batch_inference_tests.defs.helpers import check_results, history, latest


def observations(instance: dg.DagsterInstance, key: dg.AssetKey, partition: str) -> list[dict]:
    records = instance.fetch_observations(dg.AssetRecordsFilter(asset_key=key, asset_partitions=[partition]), limit=100).records
    return [{k: v.value for k, v in r.asset_observation.metadata.items()} for r in records]


def decide_some(spec: PipelineSpec, r: int, n: int, reviewer: str) -> int:
    """``n`` verdicts through the pipeline-layer queue (what the review server calls); returns how many."""

    async def go() -> int:
        q = rv.ReviewQueue(spec)
        await q.refresh()
        done = 0
        while done < n and (claim := await q.claim(reviewer, round=r)) is not None:
            item, _ = claim
            await q.decide(reviewer, r, item.id, "reject" if item.id.endswith(("1", "3")) else "approve", reason="off topic")
            done += 1
        return done

    return asyncio.run(go())


def test_sensor_waits_for_review_then_advances(defs, instance, write_spec) -> None:
    spec_path = write_spec("rev", records=12, max_rounds=2, judge={"kind": "human"},
                           review={"url": "http://127.0.0.1:9999", "warn_after": 3600})
    spec = PipelineSpec.load(spec_path)
    assert start_run(defs, instance, start_run_config(str(spec_path))).success
    first = drive(defs, instance)
    assert history(first) == [("shard_job", "rev"), ("round_job", "rev|r00")]
    rej = latest(instance, REJECTED, "rev|r00")
    assert rej["decision"] == "review" and rej["review_awaiting"] == 12
    assert rej["review_page"] == "http://127.0.0.1:9999/?round=0#run=rev"
    assert check_results(instance, REJECTED) == {"round_conservation": True, "review_age": True}

    # Ticks while reviews trickle in: the sensor waits, says so, reports progress once per change.
    cursor = first.cursor
    left = 12
    for batch in (5, 0, 4):
        left -= decide_some(spec, 0, batch, "alice")
        data = tick(defs, instance, cursor)
        cursor = data.cursor
        assert not data.run_requests
        assert data.skip_reason.skip_message == f"rev|r00: waiting for review ({left} left)"
        c = PipelineRun(spec).round_counts(0)
        assert c["inferred"] == c["approved"] + c["rejected"] + c["awaiting"] == 12 and c["awaiting"] == 12
    progress = observations(instance, REJECTED, "rev|r00")
    assert [o["review_done"] for o in progress] == [9, 5, 0]  # newest first; the unchanged tick reported nothing
    assert progress[0]["review_by_reviewer"] == {"alice": 9}

    # The oldest waiting record passes the threshold: the check warns on the next tick.
    opened = PipelineRun(spec).ledger
    info = opened.read(rv.ledger_open(0))
    opened.write(rv.ledger_open(0), {**info, "opened_at": info["opened_at"] - 7200})
    tick(defs, instance, cursor)
    assert check_results(instance, REJECTED)["review_age"] is False

    decide_some(spec, 0, 3, "bob")
    rest = drive(defs, instance, cursor=cursor)
    assert history(rest)[0] == ("review_job", "rev|r00")
    reviewed = latest(instance, REVIEWED, "rev|r00")
    assert reviewed["review_by_reviewer"] == {"alice": 9, "bob": 3} and reviewed["decision"] == "next_round"
    # the round's figures count the people's verdicts (the judge's, on rejected, were 0 and 0)
    assert (reviewed["approved"], reviewed["rejected"]) == (reviewed["review_approved"], reviewed["review_rejected"])
    assert reviewed["approved"] + reviewed["rejected"] == 12 and reviewed["approval_rate"] == round(reviewed["approved"] / 12, 4)
    assert f"| round 00 -> next_round | 12 | {reviewed['approved']} | {reviewed['rejected']} | 0 |" in reviewed["funnel"]
    assert ("round_job", "rev|r01") in history(rest)
    # round 1 waits for review again; its records are the ones people rejected
    rej1 = latest(instance, REJECTED, "rev|r01")
    assert rej1["decision"] == "review" and rej1["review_awaiting"] == reviewed["review_rejected"] > 0
    decide_some(spec, 1, 100, "carol")
    final = drive(defs, instance, cursor=rest.cursor)
    assert history(final)[0] == ("review_job", "rev|r01") and history(final)[-1] == ("results_job", "rev")
    res = latest(instance, RESULTS, "rev")
    assert res["conservation_ok"] is True and res["approved"] + res["exhausted"] == 12
    for r in (0, 1):
        c = PipelineRun(spec).round_counts(r)
        assert c["inferred"] == c["approved"] + c["rejected"] + c["awaiting"] and c["awaiting"] == 0


def test_a_round_whose_close_reopens_is_waited_on_and_closed_by_a_later_review_job(defs, instance, write_spec, monkeypatch) -> None:
    """An undo lands between the close's status read and its marker: review_job fails (the close
    reopened the round instead of sealing it undecided); the sensor waits on the round again and,
    once the record is decided, requests the close once more under a new run key."""
    spec_path = write_spec("reo", records=4, max_rounds=1, judge={"kind": "human"})
    spec = PipelineSpec.load(spec_path)
    assert start_run(defs, instance, start_run_config(str(spec_path))).success
    first = drive(defs, instance)
    q = rv.ReviewQueue(spec)

    async def approve_all() -> None:
        await q.refresh()
        while (claim := await q.claim("alice")) is not None:
            await q.decide("alice", 0, claim[0].key, "approve")

    asyncio.run(approve_all())
    undone: list = []
    real_write = Ledger.write

    def undo_before_the_marker(self: Ledger, name: str, data: dict) -> None:
        if name == rv.ledger_closing(0) and not data.get("reopened") and not undone:
            undone.append(asyncio.run(q.undo("alice")))
        real_write(self, name, data)

    monkeypatch.setattr(Ledger, "write", undo_before_the_marker)
    rest = drive(defs, instance, cursor=first.cursor)
    assert [(r.job_name, r.run_key, r.success) for r in rest.launched] == [("review_job", "reo|r00:review", False)]
    assert "reopened" in (rest.launched[0].error or "")
    data = tick(defs, instance, rest.cursor)
    assert not data.run_requests and data.skip_reason.skip_message == "reo|r00: waiting for review (1 left)"
    item, _ = undone[0]
    asyncio.run(q.decide("alice", 0, item.key, "reject", reason="second look"))
    final = drive(defs, instance, cursor=data.cursor)
    assert [(r.job_name, r.run_key) for r in final.launched][:1] == [("review_job", "reo|r00:review-reopened-1")]
    assert history(final)[-1] == ("results_job", "reo")
    reviewed = latest(instance, REVIEWED, "reo|r00")
    assert (reviewed["review_approved"], reviewed["review_rejected"]) == (3, 1)
    c = PipelineRun(spec).round_counts(0)
    assert c["inferred"] == c["approved"] + c["rejected"] + c["awaiting"] == 4 and c["awaiting"] == 0


@pytest.mark.process
def test_sensor_ticks_while_a_reviewer_works_through_the_real_server(defs, instance, write_spec) -> None:
    """Verdicts trickle in over HTTP from another thread while the sensor ticks; it advances once, when the queue is empty."""
    import re
    import threading
    import time

    import aiohttp

    from batch_inference_tests.review.helpers import ReviewServer

    spec_path = write_spec("drip", records=16, max_rounds=1, judge={"kind": "human"})
    spec = PipelineSpec.load(spec_path)
    assert start_run(defs, instance, start_run_config(str(spec_path))).success
    first = drive(defs, instance)
    assert history(first)[-1] == ("round_job", "drip|r00")
    server = ReviewServer(spec_path, "--as", "erin").start()
    errors: list[BaseException] = []

    def reviewer() -> None:
        async def go() -> None:
            async with aiohttp.ClientSession() as s:
                while True:
                    async with s.post(server.url + "/api/next", json={}) as resp:
                        record = (await resp.json())["record"]
                    if record is None:
                        return
                    async with s.post(server.url + "/api/verdict", json={"round": 0, "id": record["id"], "verdict": "approve"}) as resp:
                        assert resp.status == 200
                    await asyncio.sleep(0.05)

        try:
            asyncio.run(go())
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)

    thread = threading.Thread(target=reviewer)
    try:
        thread.start()
        cursor, lefts, requested = first.cursor, [], []
        deadline = time.monotonic() + 120
        while not requested and time.monotonic() < deadline:
            before = cursor  # the daemon launches what a tick requests; here drive() does, from this cursor
            data = tick(defs, instance, cursor)
            cursor = data.cursor
            requested = [(r.job_name, r.partition_key) for r in data.run_requests]
            c = PipelineRun(spec).round_counts(0)
            assert c["inferred"] == c["approved"] + c["rejected"] + c["awaiting"] == 16
            if not requested:
                lefts.append(int(re.search(r"\((\d+) left\)", data.skip_reason.skip_message).group(1)))
                time.sleep(0.02)
        thread.join(60)
    finally:
        server.stop()
    assert not errors, errors
    assert requested == [("review_job", "drip|r00")]
    assert lefts == sorted(lefts, reverse=True) and lefts[0] > 0 and len(set(lefts)) > 2  # seen while it drained
    rest = drive(defs, instance, cursor=before)
    assert history(rest) == [("review_job", "drip|r00"), ("results_job", "drip")]
    res = latest(instance, RESULTS, "drip")
    assert res["conservation_ok"] is True and res["approved"] == 16
    assert latest(instance, REVIEWED, "drip|r00")["review_by_reviewer"] == {"erin": 16}
