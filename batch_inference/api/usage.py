"""Who used what: every batch's tokens, requests by outcome and engine-seconds, by project and model.

``UsageBook`` follows every batch state the manager saves (``observe``) and every task
result of the pools (``task_done``), and keeps one record a batch in storage,
``usage/<batch id>.json``, rewritten atomically as it grows, so usage survives a restart (a
SIGKILL included) as the batch state does:

- ``engine_seconds``, ``engine_input_tokens`` / ``engine_output_tokens``: what the engine
  spent on the batch's tasks as they return (judge attempts, retries and a cancelled
  task's last chunk included);
- once the batch has ended (``final``): ``input_tokens`` / ``output_tokens``, the sums of
  the ``usage`` of its output file's lines (the batch's own ``usage``), and ``requests`` by
  outcome (``completed``, ``failed``, ``expired``, ``cancelled``; they sum to the batch's
  requests).

``usage_page`` reads them back in the shape of OpenAI's ``GET
/v1/organization/usage/completions`` (a page of time buckets, a batch in the bucket it ended
in). A record outlives its batch (deleting a batch does not un-spend it). The book also
holds the last state of every batch (``states``): what ``/metrics`` and the admission's
estimates read without going to storage.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import orjson
from aiohttp import web

from batch_inference.api.config import DEFAULT_PROJECT
from batch_inference.api.store import Store
from batch_inference.pool.protocol import TaskResult

log = logging.getLogger(__name__)

TERMINAL = ("completed", "failed", "expired", "cancelled")
OUTCOMES = ("completed", "failed", "expired", "cancelled")
BUCKETS = {"1m": (60, 60, 1440), "1h": (3600, 24, 168), "1d": (86400, 7, 31)}  # width: (seconds, default limit, most), OpenAI's
GROUPS = ("project_id", "user_id", "api_key_id", "model", "batch")


class UsageError(ValueError):
    """A usage query the server refuses (400), naming the parameter."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _record(batch: str, project: str, model: str | None) -> dict[str, Any]:
    return {"batch_id": batch, "project": project, "model": model, "final": False, "status": None, "ended_at": None,
            "input_tokens": 0, "output_tokens": 0, "requests": dict.fromkeys(OUTCOMES, 0),
            "engine_seconds": 0.0, "engine_input_tokens": 0, "engine_output_tokens": 0}


def outcomes(state: dict[str, Any]) -> dict[str, int]:
    """An ended batch's requests by outcome: stopped ones as its end (cancelled / expired), the
    rest of its errors failed; a batch that failed as a whole (no output file) fails every request it had."""
    counts = state.get("request_counts") or {}
    total, completed, failed = int(counts.get("total") or 0), int(counts.get("completed") or 0), int(counts.get("failed") or 0)
    stopped = int(state.get("stopped") or 0)
    out = dict.fromkeys(OUTCOMES, 0)
    if state["status"] == "failed":
        out["failed"] = max(total, failed)
    elif state["status"] in ("expired", "cancelled"):
        out["completed"], out[state["status"]], out["failed"] = completed, stopped, failed - stopped
    else:
        out["completed"], out["failed"] = completed, failed
    return out


class UsageBook:
    """Usage records of every batch (``usage/<id>.json``) and the last state of each batch."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.records: dict[str, dict[str, Any]] = {}
        self.states: dict[str, dict[str, Any]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def url(self, batch: str) -> str:
        return self.store.url("usage", f"{batch}.json")

    async def open(self, states: Iterable[dict[str, Any]]) -> None:
        """At start: the stored records, and the batches as storage has them (each ended one recorded)."""

        def read() -> dict[str, dict[str, Any]]:
            found = {}
            for name in self.store.children(self.store.url("usage")):
                if name.endswith(".json") and (rec := self.store.read_json(self.url(name[:-5]))) is not None:
                    found[rec["batch_id"]] = rec
            return found

        self.records.update(await asyncio.to_thread(read))
        for state in states:
            await self.observe(state)

    async def observe(self, state: dict[str, Any]) -> None:
        """A batch state was saved: remember it; record an ended batch's usage once."""
        self.states[state["id"]] = state
        if state["status"] not in TERMINAL:
            return
        rec = self.records.get(state["id"])
        if rec is not None and rec["final"]:
            return
        rec = rec or _record(state["id"], str(state.get("project") or DEFAULT_PROJECT), state.get("model"))
        usage = state.get("usage") or {}
        rec.update(final=True, status=state["status"], model=state.get("model"), requests=outcomes(state),
                   input_tokens=int(usage.get("input_tokens") or 0), output_tokens=int(usage.get("output_tokens") or 0),
                   ended_at=int(state.get(f"{state['status']}_at") or time.time()))
        self.records[state["id"]] = rec
        await self._write(state["id"])

    async def task_done(self, batch: str, result: TaskResult) -> None:
        """A task of ``batch`` returned: its engine-seconds and tokens join the batch's record."""
        state = self.states.get(batch) or {}
        rec = self.records.get(batch)
        if rec is None:
            rec = self.records[batch] = _record(batch, str(state.get("project") or DEFAULT_PROJECT), state.get("model") or state.get("run"))
        rec["engine_seconds"] += float(result.engine_busy_s)
        rec["engine_input_tokens"] += int(result.tokens_in)
        rec["engine_output_tokens"] += int(result.tokens_out)
        await self._write(batch)

    async def _write(self, batch: str) -> None:
        """Save a record; writes of one batch in turn, each with the record as it is then (the last write is the latest)."""
        async with self._locks.setdefault(batch, asyncio.Lock()):
            data = dict(self.records[batch], requests=dict(self.records[batch]["requests"]))
            await asyncio.to_thread(self.store.write_json, self.url(batch), data)

    # -- reading back ---------------------------------------------------------------------

    def usage_page(self, query: dict[str, list[str]], *, project: str | None, now: int) -> dict[str, Any]:
        """OpenAI's usage page over the ended batches (``query``: the URL's parameters, each a list).

        ``project``: the caller's project, whose usage alone it sees (None: every project's,
        an admin key). Parameters: ``start_time`` (required), ``end_time``, ``bucket_width``
        (``1m``, ``1h``, ``1d``), ``project_ids``, ``models``, ``batch``, ``group_by``
        (``project_id``, ``model``, ``batch``; ``user_id`` and ``api_key_id`` group nothing
        here: null), ``limit`` and ``page`` (the cursor ``next_page`` gave)."""
        start = _int(query, "start_time", required=True)
        width_name = _one(query, "bucket_width") or "1d"
        if width_name not in BUCKETS:
            raise UsageError(f"bucket_width {width_name!r}: one of {', '.join(BUCKETS)}", "bucket_width")
        width, default_limit, most = BUCKETS[width_name]
        end = _int(query, "end_time")
        end = end if end is not None else now + 1
        limit = _int(query, "limit")
        limit = default_limit if limit is None else limit
        if not 1 <= limit <= most:
            raise UsageError(f"limit {limit}: between 1 and {most} for bucket_width {width_name}", "limit")
        page = _int(query, "page")
        first = start if page is None else page
        if first < start or (first - start) % width:
            raise UsageError("page: not a cursor of this query (use next_page)", "page")
        group_by = [g for raw in _list(query, "group_by") for g in raw.split(",") if g]
        for g in group_by:
            if g not in GROUPS:
                raise UsageError(f"group_by {g!r}: one of {', '.join(GROUPS)}", "group_by")
        projects, models = set(_list(query, "project_ids")), set(_list(query, "models"))
        batch_only = _one(query, "batch")
        records = [r for r in self.records.values() if r["final"] and (project is None or r["project"] == project)
                   and (not projects or r["project"] in projects) and (not models or r["model"] in models)]
        if batch_only is not None and batch_only.lower() in ("false", "0"):
            records = []  # every request this server runs is a batch's
        buckets = []
        t = first
        while t < end and len(buckets) < limit:
            upper = min(t + width, end)
            inside = [r for r in records if t <= int(r["ended_at"]) < upper]
            buckets.append({"object": "bucket", "start_time": t, "end_time": t + width, "results": _results(inside, group_by)})
            t += width
        more = t < end
        return {"object": "page", "data": buckets, "has_more": more, "next_page": str(t) if more else None}


def _results(records: list[dict[str, Any]], group_by: list[str]) -> list[dict[str, Any]]:
    """One result per group (all of the bucket's records in one when ``group_by`` is empty; none when empty)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in records:
        key = tuple(r["project"] if g == "project_id" else r["model"] if g == "model" else True if g == "batch" else None
                    for g in group_by)
        groups.setdefault(key, []).append(r)
    out = []
    for key, rs in sorted(groups.items(), key=lambda kv: tuple(str(k) for k in kv[0])):
        named = dict(zip(group_by, key))
        requests = {o: sum(r["requests"][o] for r in rs) for o in OUTCOMES}
        out.append({
            "object": "organization.usage.completions.result",
            "input_tokens": sum(r["input_tokens"] for r in rs), "output_tokens": sum(r["output_tokens"] for r in rs),
            "input_cached_tokens": 0, "input_audio_tokens": 0, "output_audio_tokens": 0,
            "num_model_requests": requests["completed"],
            "project_id": named.get("project_id"), "user_id": None, "api_key_id": None,
            "model": named.get("model"), "batch": named.get("batch"),
            # ours, beside OpenAI's fields
            "requests": requests, "engine_seconds": round(sum(r["engine_seconds"] for r in rs), 6),
        })
    return out


def _list(query: dict[str, list[str]], name: str) -> list[str]:
    """A parameter's values, as ``name=a&name=b`` or ``name[]=a`` send them."""
    return [v for v in query.get(name, []) + query.get(f"{name}[]", []) if v]


def _one(query: dict[str, list[str]], name: str) -> str | None:
    values = _list(query, name)
    return values[-1] if values else None


def _int(query: dict[str, list[str]], name: str, *, required: bool = False) -> int | None:
    raw = _one(query, name)
    if raw is None:
        if required:
            raise UsageError(f"{name}: required (Unix seconds)", name)
        return None
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"{name} {raw!r}: an integer", name) from None


def usage_route(book: UsageBook, project_key: web.RequestKey[str], admin_project: str | None
                ) -> Callable[[web.Request], Awaitable[web.Response]]:
    """``GET /v1/organization/usage/completions``: the caller's project's usage (every project's
    for a key of ``admin_project``); a bad parameter is OpenAI's 400 naming it."""

    async def usage_completions(request: web.Request) -> web.Response:
        project = request[project_key]
        query = {k: request.query.getall(k) for k in set(request.query.keys())}
        try:
            page = book.usage_page(query, project=None if project == admin_project else project, now=int(time.time()))
        except UsageError as exc:
            body = {"error": {"message": str(exc), "type": "invalid_request_error", "param": exc.param, "code": None}}
            return web.Response(body=orjson.dumps(body), status=400, content_type="application/json")
        return web.Response(body=orjson.dumps(page), content_type="application/json", headers={"Cache-Control": "no-store"})

    return usage_completions
