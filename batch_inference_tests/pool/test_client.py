"""PoolClient retry and routing logic against scripted HTTP endpoints on loopback."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from batch_inference.pool import PoolClient, TaskFailed, TaskResult, TaskSpec
from batch_inference_tests.fixtures.pool import infer_spec

pytestmark = pytest.mark.process  # workers faked by aiohttp servers listening on 127.0.0.1

SPEC: TaskSpec = infer_spec("t1", "/data/in.jsonl", "/data/out.jsonl")


def _ok(worker: str) -> web.Response:
    result = TaskResult(task_id=SPEC.task_id, kind="infer", worker=worker, counts={"ok": 1, "error": 0}, records_in=1)
    return web.Response(body=result.model_dump_json(), content_type="application/json")


class Scripted:
    """A fake worker answering POST /tasks from a script of (status | 'hang' | 'ok')."""

    def __init__(self, name: str, script: list[int | str], delay_s: float = 0.0) -> None:
        self.name, self.script, self.delay_s = name, list(script), delay_s
        self.hits = 0
        self.concurrent = self.peak = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        self.concurrent += 1
        self.peak = max(self.peak, self.concurrent)
        try:
            step = self.script.pop(0) if self.script else "ok"
            await asyncio.sleep(self.delay_s)
            if step == "hang":
                await asyncio.sleep(3600)
            if step == "ok":
                return _ok(self.name)
            return web.json_response({"error": f"scripted {step}", "retryable": step >= 500 or step == 429}, status=int(step))
        finally:
            self.concurrent -= 1


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., asyncio.Future]]:
    servers: list[TestServer] = []

    async def start(worker: Scripted) -> str:
        app = web.Application()
        app.router.add_post("/tasks", worker.handle)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return str(server.make_url("")).rstrip("/")

    yield start
    for server in servers:
        await server.close()


def _dead_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: connection refused


async def test_retries_a_5xx_on_another_worker(serve) -> None:
    a, b = Scripted("a", [500]), Scripted("b", [500])
    async with PoolClient([await serve(a), await serve(b)], retries=3, backoff_s=0.01) as pool:
        result = await pool.run_task(SPEC)
        assert pool.retried == 2
    assert result.worker in ("a", "b") and a.hits + b.hits == 3
    assert a.hits >= 1 and b.hits >= 1  # the retry went to the other worker


async def test_exhausted_retries_raise_task_failed_with_every_error(serve) -> None:
    a = Scripted("a", [502] * 10)
    async with PoolClient([await serve(a)], retries=2, backoff_s=0.01) as pool:
        with pytest.raises(TaskFailed) as info:
            await pool.run_task(SPEC)
    assert info.value.spec == SPEC and len(info.value.errors) == 3 and a.hits == 3
    assert all("HTTP 502" in e for e in info.value.errors)


async def test_deterministic_refusal_is_not_retried(serve) -> None:
    a = Scripted("a", [422])
    async with PoolClient([await serve(a)], retries=3, backoff_s=0.01) as pool:
        with pytest.raises(TaskFailed, match="HTTP 422"):
            await pool.run_task(SPEC)
    assert a.hits == 1


async def test_busy_refusals_wait_without_using_retries(serve) -> None:
    a = Scripted("a", [429, 429, 503, 429])
    async with PoolClient([await serve(a)], retries=0, backoff_s=0.01) as pool:
        result = await pool.run_task(SPEC)
        assert pool.retried == 0
    assert result.worker == "a" and a.hits == 5


async def test_dead_and_hung_workers_are_skipped(serve) -> None:
    hung = Scripted("hung", ["hang"])
    good = Scripted("good", [])
    endpoints = [_dead_endpoint(), await serve(hung), await serve(good)]
    async with PoolClient(endpoints, retries=3, backoff_s=0.01, timeout_s=0.5) as pool:
        results = await asyncio.gather(*(pool.run_task(SPEC.model_copy(update={"task_id": f"t{i}"})) for i in range(3)))
        assert pool.down_until  # the dead endpoint was marked down
    assert all(r.worker in ("good", "hung") for r in results) and good.hits >= 2


async def test_least_loaded_worker_gets_the_next_task(serve) -> None:
    a, b = Scripted("a", [], delay_s=0.2), Scripted("b", [], delay_s=0.2)
    async with PoolClient([await serve(a), await serve(b)], concurrency=2) as pool:
        assert pool.limit == 4
        await asyncio.gather(*(pool.run_task(SPEC) for _ in range(4)))
    assert a.hits == b.hits == 2 and a.peak == b.peak == 2


async def test_refresh_replaces_endpoints_after_a_death(serve) -> None:
    good = Scripted("good", [])
    good_url = await serve(good)
    refreshed = asyncio.Event()

    async def refresh() -> list[str]:
        refreshed.set()
        return [good_url]

    async with PoolClient([_dead_endpoint()], retries=2, backoff_s=0.05, refresh=refresh) as pool:
        result = await pool.run_task(SPEC)
    assert refreshed.is_set() and result.worker == "good" and pool.endpoints == [good_url]


def _family_spec(i: int, family: str) -> TaskSpec:
    return SPEC.model_copy(update={"task_id": f"{family}-{i}", "affinity": family})


async def test_a_family_goes_to_one_worker_while_it_has_a_free_slot(serve) -> None:
    from batch_inference.pool.client import rendezvous

    workers = [Scripted(n, []) for n in "abc"]
    urls = [await serve(w) for w in workers]
    name = dict(zip(urls, "abc"))
    families = [f"family{i}" for i in range(12)]
    async with PoolClient(urls, concurrency=2) as pool:
        for family in families:  # one at a time: every worker has a free slot
            ran = {(await pool.run_task(_family_spec(i, family))).worker for i in range(3)}
            assert ran == {name[max(urls, key=lambda u: rendezvous(family, u))]}, family
        assert (pool.affinity_kept, pool.affinity_moved) == (36, 0)
    # the families spread as their rendezvous order says
    assert {w.name for w in workers if w.hits} == {name[max(urls, key=lambda u: rendezvous(f, u))] for f in families}
    # the family's worker full: the next task goes to the family's next worker at once
    slow = [Scripted(n, [], delay_s=0.3) for n in "ab"]
    urls = [await serve(w) for w in slow]
    family = "big"
    first, second = sorted(urls, key=lambda u: rendezvous(family, u), reverse=True)
    async with PoolClient(urls, concurrency=1) as pool:
        results = await asyncio.gather(*(pool.run_task(_family_spec(i, family)) for i in range(2)))
        assert pool.affinity_moved == 1
    assert sorted(r.worker for r in results) == ["a", "b"] and max(w.peak for w in slow) == 1


async def test_new_families_spread_over_idle_workers_and_keep_theirs(serve) -> None:
    from batch_inference.pool.client import rendezvous

    workers = [Scripted(n, [], delay_s=0.2) for n in "ab"]
    urls = [await serve(w) for w in workers]
    name = dict(zip(urls, "ab"))
    # four families that all rank worker a first: by rendezvous alone b would stay idle
    families = [f for f in (f"f{i}" for i in range(1000)) if max(urls, key=lambda u: rendezvous(f, u)) == urls[0]][:4]
    async with PoolClient(urls, concurrency=4) as pool:
        first = await asyncio.gather(*(pool.run_task(_family_spec(0, f)) for f in families))
        assert sorted(r.worker for r in first) == ["a", "a", "b", "b"]
        home = {f: r.worker for f, r in zip(families, first)}
        assert {name[pool.homes[f]] for f in families} == set(home.values())
        # the families' later shards follow them, concurrently too
        later = await asyncio.gather(*(pool.run_task(_family_spec(i, f)) for f in families for i in (1, 2)))
        assert [r.worker for r in later] == [home[f] for f in families for _ in (1, 2)]
        assert (pool.affinity_kept, pool.affinity_moved) == (12, 0)
    assert max(w.peak for w in workers) <= 4


async def test_a_family_never_piles_on_its_worker_while_another_has_room(serve) -> None:
    # issue 27 item 7: tasks of one family dispatched at once went to its worker until its
    # slots were full, the other worker idle; balance comes first, the family's worker takes its share
    workers = [Scripted(n, [], delay_s=0.2) for n in "ab"]
    urls = [await serve(w) for w in workers]
    async with PoolClient(urls, concurrency=8) as pool:
        ran = await asyncio.gather(*(pool.run_task(_family_spec(i, "preamble")) for i in range(8)))
        assert sorted(r.worker for r in ran) == ["a"] * 4 + ["b"] * 4
        assert (pool.affinity_kept, pool.affinity_moved) == (4, 4)
        # the tail: two tasks, two idle workers: one each, the family's worker among them
        home = {u: w.name for u, w in zip(urls, workers)}[pool.homes["preamble"]]
        tail = await asyncio.gather(*(pool.run_task(_family_spec(i, "preamble")) for i in (8, 9)))
        assert sorted(r.worker for r in tail) == ["a", "b"] and tail[0].worker == home
    assert max(w.peak for w in workers) == 4


async def test_affinity_falls_back_when_its_worker_dies_and_stays_on_the_fallback(serve) -> None:
    from batch_inference.pool.client import rendezvous

    alive = [Scripted(n, []) for n in "ab"]
    dead = _dead_endpoint()
    urls = [await serve(w) for w in alive]
    # a family whose worker is the dead endpoint
    family = next(f"f{i}" for i in range(1000) if max([dead, *urls], key=lambda u: rendezvous(f"f{i}", u)) == dead)
    fallback = {u: w.name for u, w in zip(urls, alive)}[max(urls, key=lambda u: rendezvous(family, u))]
    async with PoolClient([dead, *urls], retries=3, backoff_s=0.01, down_cooldown_s=60) as pool:
        ran = [(await pool.run_task(_family_spec(i, family))).worker for i in range(4)]
        assert dead in pool.down_until
    assert ran == [fallback] * 4  # the next worker in the family's order, every time



async def test_a_worker_never_reached_costs_no_retry_while_the_task_waits_for_one(serve) -> None:
    # a spot reclaim: the task's workers are gone and the replacements are not up yet; with
    # no retries left to spend it still runs once a refresh names a live worker
    good = Scripted("good", [])
    good_url, dead = await serve(good), _dead_endpoint()
    calls = 0

    async def refresh() -> list[str]:
        nonlocal calls
        calls += 1
        return [dead] if calls < 3 else [dead, good_url]  # Endpoints still list the dead pod

    async with PoolClient([dead], retries=0, backoff_s=0.02, down_cooldown_s=60, refresh=refresh) as pool:
        result = await pool.run_task(SPEC)
        assert pool.retried == 0 and dead in pool.down_until  # a refresh listing it again keeps it down
        more = await asyncio.gather(*(pool.run_task(SPEC.model_copy(update={"task_id": f"m{i}"})) for i in range(4)))
    assert result.worker == "good" and all(r.worker == "good" for r in more) and good.hits == 5


async def test_no_worker_reachable_for_longer_than_the_bound_fails_the_task_naming_them() -> None:
    dead = _dead_endpoint()
    async with PoolClient([dead], retries=5, backoff_s=0.02, max_unreachable_s=0.3) as pool:
        with pytest.raises(TaskFailed) as info:
            await pool.run_task(SPEC)
    assert any(dead in e for e in info.value.errors) and "no worker could be reached" in info.value.errors[-1]


async def test_a_task_whose_familys_worker_is_full_goes_to_a_worker_with_room(serve) -> None:
    # the family's worker had no free slot, so it was not among the workers sharing the fresh
    # tasks: placing the task raised KeyError in the event loop's callback and it waited forever
    workers = [Scripted(n, [], delay_s=0.5) for n in "ab"]
    urls = [await serve(w) for w in workers]
    async with PoolClient(urls, concurrency=1) as pool:
        first = asyncio.create_task(pool.run_task(_family_spec(0, "f")))
        await asyncio.sleep(0.1)  # placed: its worker is the family's, and now full
        second = await asyncio.wait_for(pool.run_task(_family_spec(1, "f")), 5)
        assert second.worker != (await first).worker
