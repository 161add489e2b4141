"""Anthropic's Message Batches: ``/v1/messages/batches`` (create, list, get, delete, cancel, results)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from batch_inference.api import anthropic
from batch_inference.api.batches import BatchError, new_id
from batch_inference.api.protocol import TERMINAL, BatchRecord
from batch_inference.api.routes.common import (CONFIG, MANAGER, PROJECT, STORE, batch_record, file_meta, json_body, json_response,
                                               limit_of, listing, own_batches, page)
from batch_inference.prompting.openai_batch import jsonl_line


def _results_url(request: web.Request, batch_id: str) -> str:
    base = (request.app[CONFIG].base_url or f"{request.scheme}://{request.host}").rstrip("/")
    return f"{base}/v1/messages/batches/{batch_id}/results"


def _object(request: web.Request, record: BatchRecord) -> dict[str, Any]:
    return anthropic.batch_object(record.to_json(), _results_url(request, record.id))


async def create_message_batch(request: web.Request) -> web.Response:
    config, store = request.app[CONFIG], request.app[STORE]
    body = await json_body(request)
    requests = body.get("requests")
    if not isinstance(requests, list) or not requests:
        raise BatchError("requests: a non-empty list of {custom_id, params}")
    if len(requests) > config.limits.max_lines:
        raise BatchError(f"requests: {len(requests)} requests, over this server's {config.limits.max_lines} (limits.max_lines)")
    seen: set[str] = set()
    for i, r in enumerate(requests):
        cid = r.get("custom_id") if isinstance(r, dict) else None
        if not isinstance(cid, str) or not anthropic.CUSTOM_ID.match(cid):
            raise BatchError(f"requests.{i}.custom_id: 1-64 characters of letters, digits, '_' and '-'")
        if cid in seen:
            raise BatchError(f"requests.{i}.custom_id: {cid!r} is used more than once")
        seen.add(cid)
    batch_id = new_id("msgbatch")
    source = f"{store.batch_dir(batch_id)}/requests.jsonl"

    def write() -> None:
        w = store.open_writer(source)
        for r in requests:
            w.write(orjson.dumps(r) + b"\n")
        w.commit()

    await asyncio.to_thread(write)
    record = await request.app[MANAGER].create(
        api="anthropic", endpoint="/v1/chat/completions", source_url=source, input_file_id=None,
        window=f"{int(config.limits.anthropic_window)}s", window_s=config.limits.anthropic_window, metadata=None,
        output_expires_after=None, batch_id=batch_id, project=request[PROJECT])
    return json_response(_object(request, record))


async def get_message_batch(request: web.Request) -> web.Response:
    return json_response(_object(request, await batch_record(request, request.match_info["batch_id"], "msgbatch")))


async def list_message_batches(request: web.Request) -> web.Response:
    records = await own_batches(request, "anthropic")
    limit = limit_of(request)
    if before := request.query.get("before_id"):
        ids = [r.id for r in records]
        records = records[:ids.index(before)] if before in ids else []
        more = len(records) > limit
        shown = records[-limit:]
    else:
        shown, more = page(records, limit, request.query.get("after_id"))
    return json_response(listing([_object(request, r) for r in shown], more, openai=False))


async def cancel_message_batch(request: web.Request) -> web.Response:
    record = await batch_record(request, request.match_info["batch_id"], "msgbatch")
    if record.status in ("validating", "in_progress"):
        record = await request.app[MANAGER].cancel(record.id)
    return json_response(_object(request, record))


async def delete_message_batch(request: web.Request) -> web.Response:
    record = await batch_record(request, request.match_info["batch_id"], "msgbatch")
    if record.status not in TERMINAL:
        raise BatchError(f"batch {record.id} is still processing: cancel it, and delete it once it has ended", status=409)
    await asyncio.to_thread(request.app[MANAGER].delete, record)
    return json_response({"id": record.id, "type": "message_batch_deleted"})


async def message_batch_results(request: web.Request) -> web.StreamResponse:
    record = await batch_record(request, request.match_info["batch_id"], "msgbatch")
    if record.status not in TERMINAL:
        raise BatchError(f"batch {record.id} has not ended: its results are not ready", status=404)
    urls = []
    for file_id in (record.output_file_id, record.error_file_id):
        if file_id:
            urls.append((await file_meta(request, file_id))["url"])
    response = web.StreamResponse(headers={"Content-Type": "application/binary", "Cache-Control": "no-store"})
    await response.prepare(request)
    store = request.app[STORE]
    for url in urls:
        lines = store.lines(url)
        while (raw := await asyncio.to_thread(next, lines, None)) is not None:
            if raw.strip():
                await response.write(jsonl_line(anthropic.result_line(orjson.loads(raw))))
    await response.write_eof()
    return response


ROUTES = [
    web.post("/v1/messages/batches", create_message_batch),
    web.get("/v1/messages/batches", list_message_batches),
    web.get("/v1/messages/batches/{batch_id}", get_message_batch),
    web.delete("/v1/messages/batches/{batch_id}", delete_message_batch),
    web.post("/v1/messages/batches/{batch_id}/cancel", cancel_message_batch),
    web.get("/v1/messages/batches/{batch_id}/results", message_batch_results),
]
