"""Behaviour of DynamicBatcher / TokenBatcher: each test pins one semantic (docs/batching.md)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from batch_inference.batching import DynamicBatcher, Prompt, TokenBatcher


class Recorder:
    """A process_fn that records every batch it sees (and when), returning x * 10."""

    def __init__(self, delay: float = 0.0) -> None:
        self.batches: list[list] = []
        self.times: list[float] = []
        self.delay = delay

    async def __call__(self, batch: list) -> list:
        self.batches.append(list(batch))
        self.times.append(asyncio.get_running_loop().time())
        if self.delay:
            await asyncio.sleep(self.delay)
        return [x * 10 for x in batch]


def make(fn, **kw) -> DynamicBatcher:
    opts = dict(target_batch_cost=10, max_batch_size=100, batch_timeout_s=0.05, prefetch_batches=2, max_queue_size=1000)
    opts.update(kw)
    return DynamicBatcher(fn, **opts)


async def test_results_come_back_in_order_per_record() -> None:
    rec = Recorder()
    async with make(rec) as b:
        futures = [await b.submit(i) for i in range(25)]
        assert await asyncio.gather(*futures) == [i * 10 for i in range(25)]
    assert [x for batch in rec.batches for x in batch] == list(range(25))


async def test_dispatch_on_cost_admits_crossing_record_in_full() -> None:
    rec = Recorder()
    async with make(rec, target_batch_cost=10) as b:
        futures = await b.submit_many([1, 2, 3, 4, 5], estimated_costs=[4, 4, 4, 4, 4])
        await asyncio.gather(*futures)
    # 4+4 = 8 < 10; the third (4) crosses to 12 and is admitted in full
    assert rec.batches == [[1, 2, 3], [4, 5]]
    assert b.stats.over_budget_batches == 1


async def test_record_larger_than_budget_forms_a_batch_alone() -> None:
    rec = Recorder()
    async with make(rec, target_batch_cost=10) as b:
        futures = await b.submit_many([1, 2, 3], estimated_costs=[1, 50, 1])
        await asyncio.gather(*futures)
    assert rec.batches == [[1, 2], [3]]  # 1 + 50 crosses: [1, 2]; then 3 alone after the timeout
    rec2 = Recorder()
    async with make(rec2, target_batch_cost=10) as b:
        futures = await b.submit_many([7, 8], estimated_costs=[50, 1])
        await asyncio.gather(*futures)
    assert rec2.batches == [[7], [8]]


async def test_strict_budget_never_exceeds_and_crossing_record_opens_next_batch() -> None:
    rec = Recorder()
    async with make(rec, target_batch_cost=10, strict_budget=True) as b:
        futures = await b.submit_many([1, 2, 3, 4, 5], estimated_costs=[4, 4, 4, 4, 2])
        await asyncio.gather(*futures)
    assert rec.batches == [[1, 2], [3, 4, 5]]  # 4+4+4 would be 12 > 10
    assert b.stats.over_budget_batches == 0


async def test_strict_budget_fails_only_a_record_that_cannot_fit_alone() -> None:
    rec = Recorder()
    async with make(rec, target_batch_cost=10, strict_budget=True) as b:
        futures = await b.submit_many([1, 2, 3], estimated_costs=[3, 11, 3])
        assert await futures[0] == 10 and await futures[2] == 30
        with pytest.raises(ValueError, match="over the strict budget"):
            await futures[1]
    assert rec.batches == [[1, 3]]
    assert b.stats.total_failed == 1


async def test_padded_cost_prices_batch_as_count_times_longest() -> None:
    rec = Recorder()
    async with make(rec, target_batch_cost=100, padded_cost=True, strict_budget=True) as b:
        # sums: 10+10+10+60 = 90 would fit a summed budget; padded: 4 x 60 = 240 does not
        futures = await b.submit_many([1, 2, 3, 4, 5], estimated_costs=[10, 10, 10, 60, 10])
        await asyncio.gather(*futures)
    assert rec.batches == [[1, 2, 3], [4], [5]]  # [4, 5] would cost 2 x 60 = 120
    assert b.stats.avg_batch_cost == pytest.approx((30 + 60 + 10) / 3)


async def test_padded_cost_without_strict_admits_crossing_record() -> None:
    rec = Recorder()
    async with make(rec, target_batch_cost=100, padded_cost=True) as b:
        futures = await b.submit_many([1, 2, 3], estimated_costs=[10, 60, 10])
        await asyncio.gather(*futures)
    assert rec.batches == [[1, 2], [3]]  # 2 x 60 = 120 >= 100 dispatches


async def test_max_batch_size_caps_records_per_batch() -> None:
    rec = Recorder()
    async with make(rec, target_batch_cost=1_000, max_batch_size=4, batch_timeout_s=5) as b:
        futures = await b.submit_many(range(10))
        await asyncio.gather(*futures[:8])
        assert [len(x) for x in rec.batches] == [4, 4]
    assert [len(x) for x in rec.batches] == [4, 4, 2]


async def test_timeout_is_measured_from_the_batchs_first_dequeued_record() -> None:
    rec = Recorder()
    loop = asyncio.get_running_loop()
    async with make(rec, target_batch_cost=1_000, batch_timeout_s=0.4) as b:
        t0 = loop.time()
        first = await b.submit(1)
        await asyncio.sleep(0.3)
        second = await b.submit(2)
        await asyncio.gather(first, second)
    assert rec.batches == [[1, 2]]
    elapsed = rec.times[0] - t0
    # dispatched 0.4 s after the first record, not 0.4 s after the second (>= 0.7 s);
    # the margin between the two absorbs a loaded CI machine's scheduling delays
    assert 0.38 <= elapsed < 0.68


async def test_partial_batch_dispatches_on_timeout_while_running() -> None:
    rec = Recorder()
    async with make(rec, target_batch_cost=1_000, batch_timeout_s=0.05) as b:
        future = await b.submit(3)
        assert await asyncio.wait_for(future, 5) == 30  # not waiting for stop()
        assert b.is_running


async def test_submit_returns_future_at_once_and_suspends_only_when_queue_full() -> None:
    gate = asyncio.Event()

    async def blocked(batch: list) -> list:
        await gate.wait()
        return batch

    b = make(blocked, target_batch_cost=1, max_batch_size=1, prefetch_batches=1, max_queue_size=3)
    await b.start()
    futures = [await asyncio.wait_for(b.submit(i), 1) for i in range(3)]
    assert not any(f.done() for f in futures)
    # the assembler drains records into the processor (1 running) and prefetch (1 ready)
    await asyncio.sleep(0.05)
    more = [await asyncio.wait_for(b.submit(i), 1) for i in range(3, 5)]  # 2 slots freed
    queued_before = b.stats.queue_depth
    producer = asyncio.create_task(b.submit(99))
    await asyncio.sleep(0.05)
    assert not producer.done(), "submit must suspend while the queue is full"
    gate.set()
    last = await asyncio.wait_for(producer, 5)
    assert await asyncio.wait_for(asyncio.gather(*futures, *more, last), 5) == [0, 1, 2, 3, 4, 99]
    assert queued_before >= 3
    await b.stop()


async def test_per_item_exception_fails_only_that_record() -> None:
    async def fn(batch: list) -> list:
        return [ValueError(f"bad {x}") if x == 2 else x for x in batch]

    async with make(fn) as b:
        futures = await b.submit_many([1, 2, 3])
        assert await futures[0] == 1 and await futures[2] == 3
        with pytest.raises(ValueError, match="bad 2"):
            await futures[1]
    assert (b.stats.total_completed, b.stats.total_failed) == (2, 1)


async def test_process_fn_raising_fails_that_batch_and_later_batches_go_on() -> None:
    calls = 0

    async def fn(batch: list) -> list:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("engine exploded")
        return batch

    async with make(fn, max_batch_size=2, target_batch_cost=100) as b:
        first = await b.submit_many([1, 2])
        results = await asyncio.gather(*first, return_exceptions=True)
        assert all(isinstance(r, RuntimeError) and "exploded" in str(r) for r in results)
        later = await b.submit_many([3, 4, 5])
        assert await asyncio.gather(*later) == [3, 4, 5]
    assert b.stats.total_failed == 2 and b.stats.total_completed == 3


async def test_wrong_result_count_is_a_value_error_naming_the_counts() -> None:
    async def fn(batch: list) -> list:
        return batch[:-1]

    async with make(fn, max_batch_size=3, target_batch_cost=100) as b:
        futures = await b.submit_many([1, 2, 3])
        for f in futures:
            with pytest.raises(ValueError, match="returned 2 results for a batch of 3 records"):
                await f


@dataclass
class Costed:
    x: int
    cost: float

    def estimate_cost(self) -> float:
        return self.cost


async def test_cost_estimate_order_explicit_then_fn_then_protocol_then_default() -> None:
    seen: list[list[int]] = []

    async def fn(batch: list) -> list:
        seen.append([getattr(r, "x", r) for r in batch])
        return batch

    # protocol method beats default; default applies to plain records
    async with make(fn, target_batch_cost=10, default_cost=5, batch_timeout_s=5) as b:
        futures = await b.submit_many([Costed(1, 9), Costed(2, 1), 3, 4])
        await asyncio.gather(*futures)
    assert seen == [[1, 2], [3, 4]]  # 9+1 = 10; then 5+5 = 10

    # an estimator function beats the protocol method; explicit beats both
    seen.clear()
    async with make(fn, target_batch_cost=10, cost_estimator=lambda r: 10, batch_timeout_s=5) as b:
        f1 = await b.submit(Costed(1, 1))  # fn says 10: a batch alone
        f2 = await b.submit(Costed(2, 1), estimated_cost=2)
        f3 = await b.submit(Costed(3, 1), estimated_cost=8)
        await asyncio.gather(f1, f2, f3)
    assert seen == [[1], [2, 3]]


async def test_token_batcher_uses_estimate_tokens_and_token_names() -> None:
    rec: list[list[str]] = []

    async def infer(batch: list[Prompt]) -> list[str]:
        rec.append([p.text for p in batch])
        return [p.text.upper() for p in batch]

    async with TokenBatcher(infer, target_batch_tokens=6, max_batch_size=10, batch_timeout_s=5) as b:
        # "a" * 8 -> 3 tokens each
        futures = [await b.submit(Prompt("a" * 8)) for _ in range(3)]
        futures.append(await b.submit(Prompt("b"), estimated_tokens=6))
        await asyncio.gather(*futures)
    assert rec == [["a" * 8] * 2, ["a" * 8, "b"]]
    assert b.stats.target_batch_cost == 6


async def test_submit_before_start_after_stop_and_start_twice_raise() -> None:
    b = make(Recorder())
    with pytest.raises(RuntimeError, match="not started"):
        await b.submit(1)
    await b.start()
    with pytest.raises(RuntimeError, match="already running"):
        await b.start()
    await b.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        await b.submit(1)
    with pytest.raises(RuntimeError, match="single-use"):
        await b.start()


async def test_submit_from_another_loop_says_the_future_would_never_resolve() -> None:
    async with make(Recorder()) as b:
        def other_loop() -> None:
            asyncio.run(b.submit(1))

        with pytest.raises(RuntimeError, match="would never resolve"):
            await asyncio.to_thread(other_loop)
        assert await (await b.submit(2)) == 20  # still serving its own loop


async def test_cancelled_waiting_producer_does_not_break_the_batcher() -> None:
    gate = asyncio.Event()

    async def fn(batch: list) -> list:
        await gate.wait()
        return batch

    async with make(fn, max_batch_size=1, target_batch_cost=100, prefetch_batches=1, max_queue_size=1) as b:
        futures = [await b.submit(0)]
        await asyncio.sleep(0.02)
        futures.append(await b.submit(1))
        await asyncio.sleep(0.02)
        futures.append(await b.submit(2))  # queue now full
        waiting = asyncio.create_task(b.submit(3))
        await asyncio.sleep(0.02)
        assert not waiting.done()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        # a cancelled result future is skipped, not a crash
        doomed = futures.pop()
        doomed.cancel()
        gate.set()
        futures.append(await asyncio.wait_for(b.submit(4), 5))
        assert await asyncio.wait_for(asyncio.gather(*futures), 5) == [0, 1, 4]
    assert b.stats.total_cancelled == 1


async def test_min_batch_size_never_strands_or_reorders_the_tail() -> None:
    rec = Recorder()
    b = make(rec, target_batch_cost=1_000, min_batch_size=4, batch_timeout_s=0.02)
    await b.start()
    futures = await b.submit_many([1, 2, 3])
    await asyncio.sleep(0.1)  # well past the timeout: held open, below min_batch_size
    assert rec.batches == []
    futures += await b.submit_many([4, 5])
    await asyncio.sleep(0.1)
    assert rec.batches == [[1, 2, 3, 4, 5]]
    futures += await b.submit_many([6, 7])
    await b.stop()  # the undersized tail is processed, in order
    assert rec.batches == [[1, 2, 3, 4, 5], [6, 7]]
    assert [f.result() for f in futures] == [10, 20, 30, 40, 50, 60, 70]


async def test_stop_drains_everything_submitted() -> None:
    rec = Recorder(delay=0.01)
    b = make(rec, target_batch_cost=7, batch_timeout_s=10)
    await b.start()
    futures = await b.submit_many(range(50))
    await b.stop()  # no waiting for the 10 s timeout
    assert all(f.done() for f in futures)
    assert [f.result() for f in futures] == [i * 10 for i in range(50)]
    assert b.stats.total_completed == 50 and not b.is_running


async def test_producer_blocked_at_stop_gets_a_clear_error() -> None:
    gate = asyncio.Event()

    async def fn(batch: list) -> list:
        await gate.wait()
        return batch

    b = make(fn, max_batch_size=1, target_batch_cost=100, prefetch_batches=1, max_queue_size=1)
    await b.start()
    first = [await b.submit(i) for i in range(1)]
    await asyncio.sleep(0.02)
    first += [await b.submit(1)]
    await asyncio.sleep(0.02)
    first += [await b.submit(2)]
    blocked = asyncio.create_task(b.submit(3))
    await asyncio.sleep(0.02)
    stopper = asyncio.create_task(b.stop())
    with pytest.raises(RuntimeError, match="stopped before this record was queued"):
        await blocked
    gate.set()
    await stopper
    assert [f.result() for f in first] == [0, 1, 2]


async def test_prefetch_assembles_next_batch_while_model_runs() -> None:
    """The model call never waits for assembly: a batch is ready when it returns."""
    rec = Recorder(delay=0.03)
    async with make(rec, target_batch_cost=5, max_batch_size=5, batch_timeout_s=5, prefetch_batches=2) as b:
        futures = await b.submit_many(range(10))
        await asyncio.sleep(0.01)  # first batch is in the model, second assembled
        assert len(rec.batches) == 1
        assert b.stats.queue_depth == 5  # the prefetched batch, not still queued records
        await asyncio.gather(*futures)
    assert [len(x) for x in rec.batches] == [5, 5]
    gap = rec.times[1] - rec.times[0]
    assert gap < 0.03 + 0.02


async def test_submit_many_validates_cost_count_and_bad_costs() -> None:
    async with make(Recorder()) as b:
        with pytest.raises(ValueError, match="3 records but 2 estimated costs"):
            await b.submit_many([1, 2, 3], estimated_costs=[1, 1])
        with pytest.raises(ValueError, match=r"record 'x'.*>= 0"):
            await b.submit("x", estimated_cost=-1)


def test_constructor_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="target_batch_cost"):
        make(Recorder(), target_batch_cost=0)
    with pytest.raises(ValueError, match="min_batch_size"):
        make(Recorder(), min_batch_size=200)
    with pytest.raises(ValueError, match="prefetch_batches"):
        make(Recorder(), prefetch_batches=0)


async def test_submit_fast_path_does_not_yield_to_the_loop() -> None:
    """With room in the queue, submit() queues and returns without a suspension."""
    async with make(Recorder(), max_queue_size=1000) as b:
        ran = False

        async def other() -> None:
            nonlocal ran
            ran = True

        task = asyncio.create_task(other())
        futures = [await b.submit(i) for i in range(200)]
        futures += await b.submit_many(range(200))
        assert not ran, "submit() yielded to the event loop although the queue had room"
        await task
        await asyncio.gather(*futures)


async def test_cancelled_stop_leaves_no_future_hanging() -> None:
    async def hangs(batch: list) -> list:
        await asyncio.Event().wait()
        return batch

    b = make(hangs, max_batch_size=2, target_batch_cost=100)
    await b.start()
    futures = await b.submit_many(range(5))  # one batch in the model, the rest queued
    await asyncio.sleep(0.02)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(b.stop(), 0.1)
    assert all(f.cancelled() for f in futures)
    assert not b.is_running


class _Panic(BaseException):
    """Like pyo3's PanicException (a Rust panic in a tokenizer): not an ``Exception``."""


@pytest.mark.parametrize("raised", [_Panic("tokenizer panicked"), asyncio.CancelledError("from inside the model call")])
async def test_a_base_exception_from_the_model_fails_its_batch_and_the_batcher_keeps_serving(raised) -> None:
    calls = 0

    async def model(batch: list[int]) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise raised
        return [x * 2 for x in batch]

    async with DynamicBatcher(model, target_batch_cost=4, max_batch_size=4, batch_timeout_s=0.01) as b:
        first = await b.submit_many([1, 2, 3, 4])
        done = await asyncio.wait_for(asyncio.gather(*first, return_exceptions=True), 5)
        assert all(isinstance(r, RuntimeError) and type(raised).__name__ in str(r) for r in done), done
        later = await b.submit_many([5, 6])
        assert await asyncio.wait_for(asyncio.gather(*later), 5) == [10, 12]
    assert b.stats.total_failed == 4


def test_keyboard_interrupt_in_the_model_resolves_every_future_and_fails_loudly() -> None:
    """Ctrl-C inside the model call: it reaches the caller of the event loop, and no
    future is left pending (the batch's and the queued ones all carry the error)."""

    async def model(batch: list[int]) -> list[int]:
        raise KeyboardInterrupt

    b = DynamicBatcher(model, target_batch_cost=2, max_batch_size=2, batch_timeout_s=0.01)
    futures: list[asyncio.Future[int]] = []

    async def main() -> None:
        await b.start()
        futures.extend(await b.submit_many([1, 2, 3, 4, 5]))
        await asyncio.sleep(5)

    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(main())
        assert len(futures) == 5 and all(f.done() and isinstance(f.exception(), RuntimeError) for f in futures)
        with pytest.raises(RuntimeError, match="stopped"):
            loop.run_until_complete(b.submit(6))
        with pytest.raises(RuntimeError, match="loop failed"):
            loop.run_until_complete(b.stop())
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
