"""OpenAI's Batch API: ``POST/GET /v1/batches``, ``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``."""

from __future__ import annotations

from aiohttp import web

from batch_inference.api.batches import BatchError
from batch_inference.api.routes.common import (CONFIG, MANAGER, PROJECT, batch_record, file_meta, json_body, json_response, limit_of,
                                               listing, own_batches, page)

MAX_OUTPUT_EXPIRY_S = 30 * 86400


async def create_batch(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    body = await json_body(request)
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str):
        raise BatchError("input_file_id: required", param="input_file_id")
    meta = await file_meta(request, file_id)
    if meta["purpose"] != "batch":
        raise BatchError(f"file {file_id} has purpose {meta['purpose']!r}, not 'batch'", param="input_file_id")
    window = body.get("completion_window")
    window_s = config.window_s(window) if isinstance(window, str) else None
    if window_s is None:
        raise BatchError(f"completion_window {window!r}: this server accepts {', '.join(config.limits.completion_windows)}",
                         param="completion_window")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items())):
        raise BatchError("metadata: at most 16 string pairs (keys up to 64, values up to 512 characters)", param="metadata")
    expiry = body.get("output_expires_after")
    if expiry is not None:
        seconds = expiry.get("seconds") if isinstance(expiry, dict) else None
        if not (isinstance(expiry, dict) and expiry.get("anchor") == "created_at" and isinstance(seconds, int)
                and config.limits.min_output_expiry_s <= seconds <= MAX_OUTPUT_EXPIRY_S):
            raise BatchError(f"output_expires_after: {{anchor: created_at, seconds}} with seconds between "
                             f"{int(config.limits.min_output_expiry_s)} and {MAX_OUTPUT_EXPIRY_S}", param="output_expires_after")
    record = await request.app[MANAGER].create(api="openai", endpoint=str(body.get("endpoint")), source_url=meta["url"],
                                               input_file_id=file_id, window=window, window_s=window_s, metadata=metadata,
                                               output_expires_after=expiry, project=request[PROJECT])
    return json_response(record.public())


async def get_batch(request: web.Request) -> web.Response:
    return json_response((await batch_record(request, request.match_info["batch_id"], "batch")).public())


async def list_batches(request: web.Request) -> web.Response:
    shown, more = page(await own_batches(request, "openai"), limit_of(request), request.query.get("after"))
    return json_response(listing([r.public() for r in shown], more))


async def cancel_batch(request: web.Request) -> web.Response:
    record = await batch_record(request, request.match_info["batch_id"], "batch")
    return json_response((await request.app[MANAGER].cancel(record.id)).public())


ROUTES = [
    web.post("/v1/batches", create_batch),
    web.get("/v1/batches", list_batches),
    web.get("/v1/batches/{batch_id}", get_batch),
    web.post("/v1/batches/{batch_id}/cancel", cancel_batch),
]
