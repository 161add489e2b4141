"""Usage records and OpenAI's usage page over them (api/usage.py), in process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from batch_inference.api.store import Store
from batch_inference.api.usage import UsageBook, UsageError, outcomes
from batch_inference.pool.protocol import TaskResult

DAY = 86400


def ended(batch: str, project: str, status: str, at: int, *, total: int, completed: int, failed: int, stopped: int = 0,
          tokens: tuple[int, int] = (0, 0)) -> dict[str, Any]:
    return {"id": batch, "project": project, "model": "tiny", "run": "tiny", "status": status, f"{status}_at": at, "stopped": stopped,
            "request_counts": {"total": total, "completed": completed, "failed": failed},
            "usage": {"input_tokens": tokens[0], "output_tokens": tokens[1]}}


def test_outcomes_sum_to_the_batchs_requests() -> None:
    assert outcomes(ended("b", "p", "completed", 0, total=10, completed=8, failed=2)) == \
        {"completed": 8, "failed": 2, "expired": 0, "cancelled": 0}
    assert outcomes(ended("b", "p", "cancelled", 0, total=10, completed=3, failed=7, stopped=6)) == \
        {"completed": 3, "failed": 1, "expired": 0, "cancelled": 6}
    assert outcomes(ended("b", "p", "failed", 0, total=10, completed=4, failed=1)) == \
        {"completed": 0, "failed": 10, "expired": 0, "cancelled": 0}  # a failed batch delivers nothing


async def test_a_key_reads_its_projects_usage_in_buckets_and_a_restart_reads_the_same(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    book = UsageBook(store)
    start = 10 * DAY
    await book.observe({**ended("batch_a1", "a", "in_progress", 0, total=4, completed=0, failed=0), "status": "in_progress"})
    await book.task_done("batch_a1", TaskResult(task_id="t", kind="infer", worker="w", counts={}, records_in=4,
                                                tokens_in=40, tokens_out=8, engine_busy_s=1.5))
    await book.observe(ended("batch_a1", "a", "completed", start + 100, total=4, completed=4, failed=0, tokens=(40, 8)))
    await book.observe(ended("batch_a2", "a", "expired", start + DAY + 5, total=5, completed=1, failed=4, stopped=4, tokens=(9, 2)))
    await book.observe(ended("batch_b1", "b", "completed", start + 200, total=2, completed=2, failed=0, tokens=(20, 4)))
    page = book.usage_page({"start_time": [str(start)], "group_by": ["project_id,model"]}, project="a", now=start + 2 * DAY)
    assert page["object"] == "page" and not page["has_more"] and [b["start_time"] for b in page["data"]] == [start, start + DAY, start + 2 * DAY]
    first, second, third = (b["results"] for b in page["data"])
    assert [(r["project_id"], r["model"], r["input_tokens"], r["output_tokens"], r["num_model_requests"]) for r in first] == \
        [("a", "tiny", 40, 8, 4)]  # team b's batch of the same day is not a's to see
    assert first[0]["engine_seconds"] == 1.5 and second[0]["requests"] == {"completed": 1, "failed": 0, "expired": 4, "cancelled": 0}
    assert third == []
    # pages of one bucket, by the cursor
    one = book.usage_page({"start_time": [str(start)], "limit": ["1"]}, project="a", now=start + 2 * DAY)
    assert one["has_more"] and one["next_page"] == str(start + DAY) and one["data"][0]["results"][0]["project_id"] is None
    nxt = book.usage_page({"start_time": [str(start)], "limit": ["1"], "page": [one["next_page"]]}, project="a", now=start + 2 * DAY)
    assert nxt["data"][0]["start_time"] == start + DAY
    # every project's, for an admin; filters
    everyone = book.usage_page({"start_time": [str(start)], "end_time": [str(start + DAY)], "group_by": ["project_id"]}, project=None, now=0)
    assert [(r["project_id"], r["input_tokens"]) for r in everyone["data"][0]["results"]] == [("a", 40), ("b", 20)]
    only_b = book.usage_page({"start_time": [str(start)], "project_ids[]": ["b"], "end_time": [str(start + DAY)]}, project=None, now=0)
    assert only_b["data"][0]["results"][0]["input_tokens"] == 20
    assert book.usage_page({"start_time": [str(start)], "batch": ["false"]}, project=None, now=start + 1)["data"][0]["results"] == []
    for bad, param in (({}, "start_time"), ({"start_time": ["x"]}, "start_time"), ({"start_time": ["0"], "bucket_width": ["1w"]}, "bucket_width"),
                       ({"start_time": ["0"], "limit": ["32"]}, "limit"), ({"start_time": ["0"], "group_by": ["colour"]}, "group_by"),
                       ({"start_time": ["0"], "page": ["7"]}, "page")):
        with pytest.raises(UsageError) as err:
            book.usage_page(bad, project="a", now=DAY)
        assert err.value.param == param
    # persisted: a new book over the same storage reads the same
    again = UsageBook(store)
    await again.open([])
    assert again.usage_page({"start_time": [str(start)]}, project=None, now=start + 2 * DAY) == \
        book.usage_page({"start_time": [str(start)]}, project=None, now=start + 2 * DAY)
