"""``PoolClient``: the TaskRunner over HTTP workers.

It spreads tasks over the workers (least in-flight first), so ``limit`` =
replicas x concurrency tasks can be in flight. A task with a prefix family
(``TaskSpec.affinity``) goes to the family's worker, so one family's shards meet the cache
that holds its prefix. A family gets its worker with its first task: the least-loaded live
worker with a free slot, ties broken by the family's rendezvous order (each worker scored by
a hash of family and endpoint), so new families spread over idle workers instead of
piling on the one a hash prefers. A full worker passes the task to the next worker with a
free slot in rendezvous order, and a dead one hands its families to a live worker chosen
the same way: no worker waits idle for a family (bounded by its ``concurrency`` slots). A task whose worker dies, times out or
answers 5xx is retried on another worker with exponential backoff, up to ``retries``
times; "busy"/"shutting down" refusals (429/503) wait and go elsewhere without using a
retry. A deterministic refusal (400/401/403/409/413/422) or exhausted retries raise
``TaskFailed`` for the caller to quarantine; 409 (the task id is held with another spec)
raises ``TaskConflict`` and 507 (the worker's storage is full) ``OSError(ENOSPC)``, so that
the run stops instead.
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
        self.in_flight: dict[str, int] = {e: 0 for e in self.endpoints}
        self.down_until: dict[str, float] = {}
        self.retried = 0  # tasks re-sent after a failure, for reports
        self.affinity_kept = 0  # tasks of a family sent to its worker
        self.affinity_moved = 0  # sent to another (its worker full, down, or tried already)
        self.homes: dict[str, str] = {}  # family -> the worker that holds its prefix
        self._session: aiohttp.ClientSession | None = None
        self._refreshing: asyncio.Task[None] | None = None

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
        """Among live workers this task has not tried (else the one tried longest ago): the
        family's worker while it has a free slot, else the next with one in the family's
        rendezvous order; a task without a family, or with every worker full, goes to the
        least in flight."""
        now = time.monotonic()
        up = [e for e in self.endpoints if self.down_until.get(e, 0) <= now] or list(self.endpoints)
        pool = [e for e in up if e not in tried]
        if not pool:
            oldest = min(tried.get(e, -1) for e in up)
            pool = [e for e in up if tried.get(e, -1) == oldest]
        free = [e for e in pool if self.in_flight.get(e, 0) < self.concurrency]
        if family is not None and free:
            home = self.homes.get(family)
            if home not in up:  # a new family, or its worker is down or gone
                least = min(self.in_flight.get(e, 0) for e in free)
                home = max((e for e in free if self.in_flight.get(e, 0) == least), key=lambda e: rendezvous(family, e))
                self.homes.pop(family, None)
                self.homes[family] = home
                if len(self.homes) > MAX_HOMES:
                    del self.homes[next(iter(self.homes))]
            if home in free:
                self.affinity_kept += 1
                return home
            self.affinity_moved += 1
            return max(free, key=lambda e: rendezvous(family, e))
        least = min(self.in_flight.get(e, 0) for e in pool)
        return random.choice([e for e in pool if self.in_flight.get(e, 0) == least])

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
            self.endpoints = [e.rstrip("/") for e in endpoints]
            for e in self.endpoints:
                self.in_flight.setdefault(e, 0)
                self.down_until.pop(e, None)

    def _backoff(self, n: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, n - 1)) * random.uniform(0.5, 1.0)

    # -- running ------------------------------------------------------------------

    async def run_task(self, spec: TaskSpec) -> TaskResult:
        """Run ``spec`` on some worker; retried elsewhere on failure; raises ``TaskFailed``."""
        session = self._ensure_session()
        body = spec.model_dump_json().encode()
        errors: list[str] = []
        failures = refusals = 0
        tried: dict[str, int] = {}  # endpoint -> the step at which this task last went there
        for step in itertools.count():
            endpoint = self._pick(tried, spec.affinity)
            tried[endpoint] = step
            self.in_flight[endpoint] = self.in_flight.get(endpoint, 0) + 1
            try:
                async with session.post(f"{endpoint}/tasks", data=body, headers={"Content-Type": "application/json"}) as resp:
                    status, payload = resp.status, await resp.read()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                status, payload = 0, b""
                errors.append(f"{endpoint}: {type(exc).__name__}: {exc}".rstrip(": "))
                self._mark_down(endpoint)
            finally:
                self.in_flight[endpoint] -= 1
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
