"""``PoolClient``: the TaskRunner over HTTP workers.

It spreads tasks over the workers (least in-flight first), so ``limit`` =
replicas x concurrency tasks can be in flight. Load balance comes first, prefix affinity
second: the tasks that ask for a worker at once (a phase's first wave, the ones a round of
finished tasks frees) are placed together, each worker taking the share least-in-flight-
first placement would give it (``_pick_many``), so no worker sits idle while another runs
two tasks more for the sake of a cache. Within those shares a task with a prefix family
(``TaskSpec.affinity``) goes to the family's worker, so one family's shards meet the cache
that holds its prefix. A family gets its worker with its first task: the least-loaded live
worker with a free slot, ties broken by the family's rendezvous order (each worker scored by
a hash of family and endpoint), so new families spread over idle workers instead of
piling on the one a hash prefers. A task its family's worker has no share for goes to the
worker with the most share left (ties: the family's rendezvous order), and a dead worker
hands its families to a live one chosen the same way. A task whose worker dies, times out or
answers 5xx is retried on another worker with exponential backoff, up to ``retries``
times; "busy"/"shutting down" refusals (429/503) wait and go elsewhere without using a
retry. A deterministic refusal (400/401/403/409/413/422) or exhausted retries raise
``TaskFailed`` for the caller to quarantine; 409 (the task id is held with another spec)
raises ``TaskConflict`` and 507 (the worker's storage is full) ``OSError(ENOSPC)``, so that
the run stops instead. A ``run_task`` that is cancelled (its run stopped, a batch cancelled)
cancels the task on its worker (``POST /tasks/cancel``) and returns once the worker says
it has ended: no engine work goes on for a caller that left.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import itertools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp
import orjson

from batch_inference.pool.protocol import TaskConflict, TaskFailed, TaskResult, TaskSpec

log = logging.getLogger(__name__)

RefreshFn = Callable[[], Awaitable[list[str]]]
MAX_HOMES = 65_536  # families remembered (oldest forgotten first): a long-lived client stays small
CANCEL_TIMEOUT_S = 30.0  # how long a cancelled run_task waits for its worker to end the task


class PoolClient:
    """``async with PoolClient(["http://127.0.0.1:8001", ...], concurrency=10) as pool: ...``."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        concurrency: int = 10,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        timeout_s: float = 3600.0,
        connect_timeout_s: float = 5.0,
        token: str | None = None,
        max_refusals: int | None = 100,  # None: refused (busy) tasks wait as long as it takes
        down_cooldown_s: float = 5.0,
        refresh: RefreshFn | None = None,
        max_unreachable_s: float = 300.0,
    ) -> None:
        if not endpoints:
            raise ValueError("PoolClient needs at least one worker endpoint")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.concurrency = concurrency
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self.token = token
        self.max_refusals = max_refusals
        self.down_cooldown_s = down_cooldown_s
        self.refresh = refresh
        # how long a task waits for a worker it can connect to (pods replaced after a spot
        # reclaim, a pool restarting) before it fails; waiting spends none of its retries
        self.max_unreachable_s = max_unreachable_s
        self.in_flight: dict[str, int] = {e: 0 for e in self.endpoints}
        self.down_until: dict[str, float] = {}
        self.retried = 0  # tasks re-sent after a failure, for reports
        self.affinity_kept = 0  # tasks of a family sent to its worker
        self.affinity_moved = 0  # sent to another (its worker full, down, or tried already)
        self.homes: dict[str, str] = {}  # family -> the worker that holds its prefix
        self._session: aiohttp.ClientSession | None = None
        self._refreshing: asyncio.Task[None] | None = None
        self._asking: list[tuple[dict[str, int], str | None, asyncio.Future[str]]] = []  # placed together

    @property
    def limit(self) -> int:
        return len(self.endpoints) * self.concurrency

    async def __aenter__(self) -> PoolClient:
        self._ensure_session()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _ensure_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            connector = aiohttp.TCPConnector(limit=0)  # our own limit is the dispatcher's
            self._session = aiohttp.ClientSession(headers=headers, connector=connector, timeout=self.timeout)
        return self._session

    # -- choosing a worker ------------------------------------------------------

    def _pick(self, tried: dict[str, int], family: str | None = None) -> str:
        """One task's worker (``_pick_many`` of one)."""
        return self._pick_many([(tried, family)])[0]

    def _candidates(self, tried: dict[str, int]) -> list[str]:
        """Live workers this task has not tried (else those it tried longest ago)."""
        now = time.monotonic()
        up = [e for e in self.endpoints if self.down_until.get(e, 0) <= now] or list(self.endpoints)
        pool = [e for e in up if e not in tried]
        if not pool:
            oldest = min(tried.get(e, -1) for e in up)
            pool = [e for e in up if tried.get(e, -1) == oldest]
        return pool

    def _pick_many(self, asks: list[tuple[dict[str, int], str | None]]) -> list[str]:
        """Workers for tasks that ask at once (``(tried, family)`` each), counted in flight.

        Balance first: the fresh tasks (none tried yet) fill the free slots to the level
        placing them one by one on the least in flight would reach (``_shares``: each
        worker's room; which workers take the odd tasks of an uneven split is open).
        Affinity within it: a task goes to its family's worker while that has room, else
        to the worker with the most room (ties: the family's rendezvous order), which
        becomes the worker of a family it is the first of. Tasks of families that already
        have a worker are placed first. A retried task, or any left when every slot is
        taken, goes to the least in flight among the workers it has not tried.
        """
        picks: list[str | None] = [None] * len(asks)
        up = self._candidates({})
        fresh = [i for i, (tried, _) in enumerate(asks) if not tried]
        base, odd, extra = self._shares(up, len(fresh))
        given = dict.fromkeys(base, 0)
        odd_left = [extra]

        def room(e: str) -> int:
            if e not in base:  # no free slot: it takes none of the fresh tasks (a family's full worker)
                return 0
            return base[e] - given[e] + (1 if odd_left[0] > 0 and e in odd and given[e] <= base[e] else 0)

        def place(i: int, e: str) -> None:
            given[e] += 1
            if given[e] > base[e]:
                odd_left[0] -= 1
            picks[i] = e

        known = {f for _, f in asks if f is not None and self.homes.get(f) in up}
        for i in fresh:  # families with a worker already: to it while it has room
            home = self.homes.get(asks[i][1]) if asks[i][1] in known else None
            if home is not None and room(home) > 0:
                place(i, home)
                self.affinity_kept += 1
        for i in fresh:  # the rest, in order: a new family's first task settles its worker
            if picks[i] is not None or not base or not any(room(e) > 0 for e in base):
                continue
            family = asks[i][1]
            home = self.homes.get(family) if family is not None else None
            if home in given and room(home) > 0:  # a family settled earlier in this call
                place(i, home)  # type: ignore[arg-type]
                self.affinity_kept += 1
                continue
            most = max(room(e) for e in base)
            place(i, self._settle(family, [e for e in base if room(e) == most], up))
        for e in picks:
            if e is not None:
                self.in_flight[e] = self.in_flight.get(e, 0) + 1
        for i, (tried, family) in enumerate(asks):  # retried, or no free slot left anywhere
            if picks[i] is None:
                pool = self._candidates(tried)
                roomy = [e for e in pool if self.in_flight.get(e, 0) < self.concurrency] or pool
                least = min(self.in_flight.get(e, 0) for e in roomy)
                e = picks[i] = self._settle(family, [e for e in roomy if self.in_flight.get(e, 0) == least], up)
                self.in_flight[e] = self.in_flight.get(e, 0) + 1
        return picks  # type: ignore[return-value]

    def _settle(self, family: str | None, best: list[str], up: list[str]) -> str:
        """Among equally good workers: the family's when it is one of them, else the first
        in its rendezvous order, which becomes the family's worker when it has none alive."""
        if family is None:
            return random.choice(best)
        home = self.homes.get(family)
        if home in best:
            self.affinity_kept += 1
            return home  # type: ignore[return-value]
        e = max(best, key=lambda e: rendezvous(family, e))
        if home in up:
            self.affinity_moved += 1
        else:  # a new family, or its worker is down or gone
            self.homes.pop(family, None)
            self.homes[family] = e
            if len(self.homes) > MAX_HOMES:
                del self.homes[next(iter(self.homes))]
            self.affinity_kept += 1
        return e

    def _shares(self, up: list[str], tasks: int) -> tuple[dict[str, int], set[str], int]:
        """How many of ``tasks`` fresh tasks each live worker with a free slot takes, as
        least-in-flight-first placement would: ``(base, odd, extra)``: every worker takes
        its ``base``, and ``extra`` workers of ``odd`` one more (the odd tasks of an uneven
        split: which of those workers take them changes no load but the shape of a tie)."""
        load = {e: self.in_flight.get(e, 0) for e in up if self.in_flight.get(e, 0) < self.concurrency}
        n = min(tasks, sum(self.concurrency - v for v in load.values()))
        if n <= 0:
            return {}, set(), 0

        def upto(level: int) -> dict[str, int]:
            return {e: min(self.concurrency - v, max(0, level - v)) for e, v in load.items()}

        level = min(load.values()) + 1
        while sum(upto(level).values()) < n:
            level += 1
        base, most = upto(level - 1), upto(level)
        return base, {e for e in base if most[e] > base[e]}, n - sum(base.values())

    async def _choose(self, tried: dict[str, int], family: str | None) -> str:
        """This task's worker, counted in flight: placed with every task that asks in the
        same turn of the event loop (a dispatcher starting many at once), by ``_pick_many``."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[str] = loop.create_future()
        self._asking.append((tried, family, fut))
        if len(self._asking) == 1:
            loop.call_soon(self._answer)  # after the tasks already scheduled in this turn have asked
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # placed, then cancelled before it resumed
                self.in_flight[fut.result()] -= 1
            raise

    def _answer(self) -> None:
        asking, self._asking = self._asking, []
        live = [a for a in asking if not a[2].done()]
        if not live:
            return
        for (_, _, fut), endpoint in zip(live, self._pick_many([(tried, family) for tried, family, _ in live])):
            fut.set_result(endpoint)

    def _mark_down(self, endpoint: str) -> None:
        self.down_until[endpoint] = time.monotonic() + self.down_cooldown_s
        if self.refresh is not None and (self._refreshing is None or self._refreshing.done()):
            self._refreshing = asyncio.create_task(self._refresh())

    async def _refresh(self) -> None:
        try:
            endpoints = await self.refresh()  # type: ignore[misc]
        except Exception:
            log.exception("refreshing the pool's endpoints failed")
            return
        if endpoints:
            # a worker that refused connections stays down for its cooldown even if listed
            # again: Kubernetes' Endpoints lag a deleted pod by seconds, and clearing it here
            # sent the retries straight back to the dead address
            self.endpoints = [e.rstrip("/") for e in endpoints]
            for e in self.endpoints:
                self.in_flight.setdefault(e, 0)

    def _backoff(self, n: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, n - 1)) * random.uniform(0.5, 1.0)

    # -- running ------------------------------------------------------------------

    async def run_task(self, spec: TaskSpec) -> TaskResult:
        """Run ``spec`` on some worker; retried elsewhere on failure; raises ``TaskFailed``."""
        session = self._ensure_session()
        body = spec.model_dump_json().encode()
        errors: list[str] = []
        failures = refusals = unreached = 0
        unreached_since: float | None = None  # since when no worker could be connected to
        tried: dict[str, int] = {}  # endpoint -> the step at which this task last went there
        for step in itertools.count():
            endpoint = await self._choose(tried, spec.affinity)
            tried[endpoint] = step
            try:
                async with session.post(f"{endpoint}/tasks", data=body, headers={"Content-Type": "application/json"}) as resp:
                    status, payload = resp.status, await resp.read()
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                status, payload = -1, b""  # never reached a worker: it is gone, or not up yet
                errors.append(f"{endpoint}: {type(exc).__name__}: {exc}".rstrip(": "))
                self._mark_down(endpoint)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                status, payload = 0, b""
                errors.append(f"{endpoint}: {type(exc).__name__}: {exc}".rstrip(": "))
                self._mark_down(endpoint)
            except asyncio.CancelledError:
                await self._cancel_on(endpoint, spec.task_id)
                raise
            finally:
                self.in_flight[endpoint] -= 1
            if status == -1:
                # the task is not to blame for a worker it never reached: it waits for one
                # (the endpoints are refreshed) without spending a retry, up to a bound
                now = time.monotonic()
                unreached_since = now if unreached_since is None else unreached_since
                if now - unreached_since > self.max_unreachable_s:
                    raise TaskFailed(spec, [*errors[-5:], f"no worker could be reached for {now - unreached_since:.0f}s"])
                unreached += 1
                await asyncio.sleep(self._backoff(min(unreached, 5)))
                continue
            unreached_since = None
            if status == 200:
                self.down_until.pop(endpoint, None)
                return TaskResult.model_validate_json(payload)
            if status:
                message = _message(payload)
                if status in (429, 503):
                    refusals += 1
                    if self.max_refusals is not None and refusals > self.max_refusals:
                        raise TaskFailed(spec, [*errors, f"{endpoint}: {status} {message} (refused {refusals} times)"])
                    await asyncio.sleep(self._backoff(min(refusals, 5)))
                    continue
                if status == 409:  # the spec changed under a task id: the user's to resolve, never the shard's
                    raise TaskConflict(spec, f"{endpoint}: HTTP 409: {message}")
                errors.append(f"{endpoint}: HTTP {status}: {message}")
                if status < 500:  # the spec or its input is wrong: no worker will do better
                    raise TaskFailed(spec, errors)
                if status == 507:  # the worker's storage is full: stop the run, never quarantine
                    raise OSError(errno.ENOSPC, f"{endpoint}: {message}")
            failures += 1
            if failures > self.retries:
                raise TaskFailed(spec, errors)
            self.retried += 1
            log.warning("task %s failed on %s (%s); retry %d/%d", spec.task_id, endpoint, errors[-1], failures, self.retries)
            await asyncio.sleep(self._backoff(failures))
        raise AssertionError("unreachable")  # pragma: no cover

    async def _cancel_on(self, endpoint: str, task_id: str) -> None:
        """Tell ``endpoint`` to cancel ``task_id`` and wait until it has ended there (bounded),
        whatever cancels this caller meanwhile; a worker that cannot be told is logged, not
        raised: it stops the task itself once the closed connection reaches it."""
        async def tell() -> None:
            body = orjson.dumps({"task_id": task_id})
            try:
                async with self._ensure_session().post(f"{endpoint}/tasks/cancel", data=body,
                                                       headers={"Content-Type": "application/json"},
                                                       timeout=aiohttp.ClientTimeout(total=CANCEL_TIMEOUT_S)) as resp:
                    if resp.status != 200:
                        log.warning("cancelling task %s on %s: HTTP %d %s", task_id, endpoint, resp.status, _message(await resp.read()))
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                log.warning("cancelling task %s on %s failed: %s: %s", task_id, endpoint, type(exc).__name__, exc)

        telling = asyncio.ensure_future(tell())
        while not telling.done():
            try:
                await asyncio.shield(telling)
            except asyncio.CancelledError:
                continue

    # -- observability --------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        """Every worker's ``/stats`` plus a pool-level summary (unreachable workers listed)."""
        session = self._ensure_session()

        async def one(endpoint: str) -> tuple[str, dict[str, Any] | None]:
            try:
                async with session.get(f"{endpoint}/stats", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    return endpoint, (orjson.loads(await resp.read()) if resp.status == 200 else None)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                return endpoint, None

        results = dict(await asyncio.gather(*(one(e) for e in self.endpoints)))
        live = [s for s in results.values() if s]
        busy = sum(s["engine_busy_s"] for s in live)
        return {
            "workers": results,
            "unreachable": [e for e, s in results.items() if s is None],
            "replicas": len(live),
            "engine_loads": sum(s["engine_loads"] for s in live),
            "tasks_running": sum(s["tasks_running"] for s in live),
            "tasks_completed": sum(s["tasks_completed"] for s in live),
            "records_done": sum(s["records_done"] for s in live),
            "tokens_per_s": sum(s["tokens_per_s"] for s in live),
            "output_tokens_per_s": sum(s.get("output_tokens_per_s", 0.0) for s in live),
            "records_per_s": sum(s["records_per_s"] for s in live),
            "utilization": (sum(s["utilization"] for s in live) / len(live)) if live else 0.0,
            "avg_fill": (sum(s["avg_fill"] * s["engine_busy_s"] for s in live) / busy) if busy else 0.0,
            "retried": self.retried,
            "affinity": {"kept": self.affinity_kept, "moved": self.affinity_moved},
        }


def rendezvous(family: str, endpoint: str) -> int:
    """The worker's score for a family (highest random weight): every client ranks the
    workers alike, and a worker that leaves moves only its own families."""
    return int.from_bytes(hashlib.blake2b(f"{family}\x1f{endpoint}".encode(), digest_size=8).digest(), "big")


def _message(payload: bytes) -> str:
    try:
        data = orjson.loads(payload)
        return str(data.get("error", data)) if isinstance(data, dict) else str(data)
    except orjson.JSONDecodeError:
        return payload[:300].decode(errors="replace")
