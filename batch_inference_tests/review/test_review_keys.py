"""Duplicate ids under human review: each queue row has its own key, and each one is decided."""

from __future__ import annotations

import asyncio

import orjson

from batch_inference import review as rv
from batch_inference.pipeline import PipelineRun
from batch_inference.review.lifecycle import review_keys


def test_review_keys_name_each_row_once_and_never_take_another_rows_id() -> None:
    assert review_keys(["a", "b", "c"]) == ["a", "b", "c"]
    assert review_keys(["a", "b", "a", "a"]) == ["a", "b", "a#2", "a#3"]
    # an input id that already reads like a suffix keeps its name; the repeat goes past it
    assert review_keys(["a", "a", "a#2"]) == ["a", "a#3", "a#2"]
    keys = review_keys(["x#2", "x", "x", "x", "x#3"])
    assert keys == ["x#2", "x", "x#4", "x#5", "x#3"] and len(set(keys)) == 5


def test_duplicate_ids_are_each_served_and_decided_and_the_round_closes(review_spec, tmp_path) -> None:
    src = tmp_path / "input.jsonl"
    src.write_bytes(b"".join(orjson.dumps({"id": rid, "prompt": f"q{n}"}) + b"\n" for n, rid in enumerate("abaa")))
    spec, _ = review_spec(records=4)
    run = PipelineRun(spec)
    q = rv.ReviewQueue(spec)

    async def review() -> list[tuple[str, str]]:
        await q.refresh()
        seen = []
        while (claim := await q.claim("ann")) is not None:
            item, lease = claim
            assert lease.key == item.key and q.view(item, lease)["key"] == item.key
            seen.append((item.id, item.key))
            await q.decide("ann", 0, item.key, "reject" if item.key == "a#3" else "approve")
        return seen

    seen = asyncio.run(review())
    assert sorted(seen) == [("a", "a"), ("a", "a#2"), ("a", "a#3"), ("b", "b")]
    st = run.review_status(0)
    assert (st.awaiting_in, st.decided, st.left, st.resolvable) == (4, 4, 0, True)
    summary = asyncio.run(run.resolve_review(0))
    assert (summary.records, summary.approved, summary.rejected) == (4, 3, 1)
    entries = [e for e in rv.ReviewLog(run.layout, 0, None).entries() if e["kind"] == "verdict"]
    assert sorted(e["id"] for e in entries) == ["a", "a", "a", "b"]  # the log names the record's id beside its key
    c = run.round_counts(0)
    assert (c["inferred"], c["approved"], c["rejected"], c["awaiting"]) == (4, 3, 1, 0)
