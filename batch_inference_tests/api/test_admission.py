"""Admission of a model's pool by deadline, fair between projects (api/admission.py, api/fair.py), and its estimates."""

from __future__ import annotations

import asyncio
from typing import Any

from batch_inference.api.admission import Pending, Throughput, expected_finish
from batch_inference.api.fair import FairShare
from batch_inference.pool.protocol import InferConfig, TaskResult, TaskSpec


class OneSlot:
    """A pool of one slot whose tasks end when the test says."""

    limit, retried = 1, 0

    def __init__(self) -> None:
        self.gate: asyncio.Queue[None] = asyncio.Queue()

    async def stats(self) -> dict[str, Any]:
        return {}

    async def run_task(self, spec: TaskSpec) -> TaskResult:
        await self.gate.get()
        return TaskResult(task_id=spec.task_id, kind="infer", worker="w", counts={"ok": 10}, records_in=10, tokens_in=7, tokens_out=3)


def spec(n: str) -> TaskSpec:
    return TaskSpec(task_id=n, kind="infer", input_url="x", outputs={"output": "y"}, infer=InferConfig(template="{q}"))


async def grant_order(batches: list[tuple[str, float, str, int]], slack_s: float = 3600.0) -> list[str]:
    """The batch of each task the pool ran, for tasks queued (batch, deadline, project, tasks) behind one running task."""
    pool = OneSlot()
    seen: list[tuple[str, TaskResult]] = []

    async def on_result(batch: str, result: TaskResult) -> None:
        seen.append((batch, result))

    share = FairShare(pool, slack_s=slack_s, on_result=on_result)
    first = asyncio.create_task(share.for_batch("first").run_task(spec("first")))
    await asyncio.sleep(0)
    tasks = [asyncio.create_task(share.for_batch(b, deadline=d, project=p).run_task(spec(f"{b}{i}")))
             for b, d, p, n in batches for i in range(n)]
    await asyncio.sleep(0)
    for _ in range(1 + len(tasks)):
        pool.gate.put_nowait(None)
    await asyncio.gather(first, *tasks)
    assert [b for b, _ in seen][0] == "first" and len(seen) == 1 + len(tasks)  # every result reported once
    return share.granted[1:]


async def test_the_earliest_deadline_goes_first_whatever_came_before() -> None:
    order = await grant_order([("day", 86_400.0, "a", 3), ("hour", 3_600.0, "a", 2)], slack_s=60)
    assert order == ["hour", "hour", "day", "day", "day"]


async def test_projects_of_equal_deadline_take_turns_and_a_projects_batches_take_turns() -> None:
    # within the slack, deadlines are equal: project a (two batches) and project b alternate
    order = await grant_order([("a1", 1000.0, "a", 3), ("a2", 1001.0, "a", 3), ("b1", 1002.0, "b", 3)], slack_s=60)
    assert order == ["a1", "b1", "a2", "b1", "a1", "b1", "a2", "a1", "a2"]
    # beyond the slack, the later one waits
    order = await grant_order([("late", 5000.0, "b", 2), ("early", 1000.0, "a", 2)], slack_s=60)
    assert order == ["early", "early", "late", "late"]


async def test_a_cancelled_waiting_task_leaves_the_line() -> None:
    pool = OneSlot()
    share = FairShare(pool)
    first = asyncio.create_task(share.for_batch("first").run_task(spec("first")))
    await asyncio.sleep(0)
    gone = asyncio.create_task(share.for_batch("gone", deadline=1.0).run_task(spec("gone")))
    kept = asyncio.create_task(share.for_batch("kept", deadline=2.0).run_task(spec("kept")))
    await asyncio.sleep(0)
    gone.cancel()
    pool.gate.put_nowait(None)
    pool.gate.put_nowait(None)
    await asyncio.gather(first, kept)
    assert share.granted == ["first", "kept"] and not share.admission.waiting and share.free == 1


async def test_an_urgent_batchs_slot_waits_a_moment_for_its_next_task_rather_than_go_to_a_later_batch() -> None:
    pool = OneSlot()
    share = FairShare(pool, slack_s=60, hold_s=0.5)
    urgent = share.for_batch("urgent", deadline=100.0)
    first = asyncio.create_task(urgent.run_task(spec("u1")))
    await asyncio.sleep(0)
    later = asyncio.create_task(share.for_batch("later", deadline=10_000.0).run_task(spec("l1")))
    await asyncio.sleep(0)
    pool.gate.put_nowait(None)
    await first  # the urgent batch's task returned while the later one waits: its slot is kept
    assert share.granted == ["urgent"] and share.free == 0
    second = asyncio.create_task(urgent.run_task(spec("u2")))  # its run dispatches the next a moment later
    await asyncio.sleep(0)
    assert share.granted == ["urgent", "urgent"] and not later.done()
    pool.gate.put_nowait(None)
    pool.gate.put_nowait(None)
    await asyncio.wait_for(asyncio.gather(second, later), 10)  # its last slot goes to the later batch after the hold
    assert share.granted == ["urgent", "urgent", "later"]


def test_expected_finish_serves_deadline_groups_in_turn_and_shares_within_one() -> None:
    pending = [Pending("big", 100_000.0, 900), Pending("small", 100_010.0, 100), Pending("urgent", 3_600.0, 50)]
    # 10 requests/s: urgent first (5 s), then big and small share: small ends after 2 x 100, big after all 1000
    got = expected_finish(pending, 10.0, now=0.0, slack_s=60)
    assert got == {"urgent": 5, "small": 25, "big": 105}
    assert expected_finish(pending, None, now=0.0, slack_s=60) == dict.fromkeys(("big", "small", "urgent"))


def test_throughput_is_requests_over_the_span_of_recent_tasks() -> None:
    t = Throughput(window_s=100)
    assert t.rate() is None
    t.add(10, 0.0, 2.0)
    t.add(10, 1.0, 4.0)  # two tasks overlapping: 20 requests in 4 s
    assert t.rate() == 5.0
    t.add(30, 200.0, 203.0)  # the old ones fall out of the window
    assert t.rate() == 10.0
