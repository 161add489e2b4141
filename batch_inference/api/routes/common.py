"""What every route module shares: the app's keys, JSON answers in the calling API's shape,
paging, and the caller's own files and batches (a project sees only its own)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from batch_inference.api.batches import BatchError, BatchManager
from batch_inference.api.config import ApiConfig
from batch_inference.api.protocol import BatchRecord, owner
from batch_inference.api.store import Store, check_id

MANAGER = web.AppKey("manager", BatchManager)
CONFIG = web.AppKey("config", ApiConfig)
STORE = web.AppKey("store", Store)
STARTED = web.AppKey("started", int)
PROJECT = web.RequestKey("project", str)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                   405: "invalid_request_error", 409: "invalid_request_error", 413: "request_too_large", 500: "api_error"}


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json",
                        headers={"Cache-Control": "no-store"})


def is_anthropic(request: web.Request) -> bool:
    return request.path.startswith("/v1/messages")


def error_response(request: web.Request, status: int, message: str, *, param: str | None = None, code: str | None = None) -> web.Response:
    """The error in the calling API's shape."""
    if is_anthropic(request):
        return json_response({"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}, status)
    kind = {401: "invalid_request_error", 404: "invalid_request_error", 500: "server_error"}.get(status, "invalid_request_error")
    return json_response({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def page(items: list[Any], limit: int, after: str | None, key: str = "id") -> tuple[list[Any], bool]:
    """``limit`` items following the one whose id is ``after`` (the list's own order)."""
    if after is not None:
        ids = [x[key] if isinstance(x, dict) else getattr(x, key) for x in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    return items[:limit], len(items) > limit


def limit_of(request: web.Request, default: int = 20, most: int = 100) -> int:
    raw = request.query.get("limit", str(default))
    try:
        value = int(raw)
    except ValueError:
        raise BatchError(f"limit {raw!r} is not an integer", param="limit") from None
    if not 1 <= value <= most:
        raise BatchError(f"limit {value} must be between 1 and {most}", param="limit")
    return value


async def json_body(request: web.Request) -> dict[str, Any]:
    try:
        data = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise BatchError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BatchError("the request body must be a JSON object")
    return data


def file_meta_url(store: Store, file_id: str) -> str:
    return f"{store.file_dir(file_id)}/meta.json"


async def file_meta(request: web.Request, file_id: str) -> dict[str, Any]:
    """The file ``file_id`` of the caller's project; another project's answers as one that does not exist."""
    store = request.app[STORE]
    meta = await asyncio.to_thread(store.read_json, file_meta_url(store, file_id)) if check_id(file_id, "file") else None
    if meta is None or owner(meta) != request[PROJECT]:
        raise BatchError(f"No such File object: {file_id}", status=404, param="file_id")
    return meta


async def batch_record(request: web.Request, batch_id: str, prefix: str) -> BatchRecord:
    """The batch ``batch_id`` of the caller's project; another project's answers as one that does not exist."""
    record = await request.app[MANAGER].get(batch_id) if check_id(batch_id, prefix) else None
    if record is None or record.api != ("anthropic" if prefix == "msgbatch" else "openai") or owner(record) != request[PROJECT]:
        raise BatchError(f"No such batch: {batch_id}", status=404)
    return record


async def own_batches(request: web.Request, api: str) -> list[BatchRecord]:
    """The caller's project's batches of ``api``, newest first."""
    return [r for r in await request.app[MANAGER].all() if r.api == api and owner(r) == request[PROJECT]]


def listing(data: list[dict[str, Any]], more: bool, *, openai: bool = True) -> dict[str, Any]:
    """A list answer: OpenAI's (``object: list``) or Anthropic's, with its page's ids."""
    body: dict[str, Any] = {"object": "list"} if openai else {}
    body.update(data=data, has_more=more, first_id=data[0]["id"] if data else None, last_id=data[-1]["id"] if data else None)
    return body
