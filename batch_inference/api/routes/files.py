"""The Files API: upload, list, get, delete, content (``/v1/files``) and ``/v1/models``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from batch_inference.api.batches import BatchError, delete_file, new_id, now
from batch_inference.api.config import ApiConfig
from batch_inference.api.protocol import file_object, owner
from batch_inference.api.routes.common import CONFIG, PROJECT, STARTED, STORE, file_meta, file_meta_url, json_response, limit_of, listing, page
from batch_inference.api.store import check_id

CHUNK = 1 << 20
MAX_FILE_EXPIRY_S = 30 * 86400  # OpenAI's: expires_after.seconds between 3600 and 2592000


def upload_expiry(config: ApiConfig, fields: dict[str, str]) -> int | None:
    """The seconds after ``created_at`` an upload expires (its ``expires_after[anchor]`` and
    ``expires_after[seconds]``), as OpenAI takes them: anchor ``created_at``, seconds from
    ``limits.min_output_expiry_s`` (OpenAI's 3600) to 30 days; None without them."""
    anchor, raw = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and raw is None:
        return None
    least = int(config.limits.min_output_expiry_s)
    if anchor != "created_at":
        raise BatchError(f"expires_after[anchor]: {anchor!r}, must be 'created_at'", param="expires_after")
    try:
        seconds = int(raw) if raw is not None else None
    except ValueError:
        seconds = None
    if seconds is None or not least <= seconds <= MAX_FILE_EXPIRY_S:
        raise BatchError(f"expires_after[seconds]: {raw!r}, must be an integer between {least} and {MAX_FILE_EXPIRY_S}",
                         param="expires_after")
    return seconds


async def upload(request: web.Request) -> web.Response:
    config, store = request.app[CONFIG], request.app[STORE]
    limit = config.limits.max_file_bytes
    if request.content_length is not None and request.content_length > limit + (64 << 10):
        raise BatchError(f"the upload is {request.content_length} bytes, over this server's {limit} (limits.max_file_bytes)", status=413)
    try:
        reader = await request.multipart()
    except (AssertionError, ValueError, KeyError):
        raise BatchError("expected a multipart/form-data upload with fields 'file' and 'purpose'") from None
    file_id = new_id("file")
    url = f"{store.file_dir(file_id)}/content"
    fields: dict[str, str] = {}
    filename, size, writer = None, 0, None
    try:
        try:
            while (part := await reader.next()) is not None:
                if part.name == "file":  # type: ignore[union-attr]
                    if writer is not None:  # a second file would leave the first's bytes behind, and `bytes` neither's size
                        raise BatchError("the upload has more than one 'file' part: one file an upload", param="file")
                    filename = part.filename or "upload.jsonl"  # type: ignore[union-attr]
                    writer = store.open_writer(url)
                    while chunk := await part.read_chunk(CHUNK):  # type: ignore[union-attr]
                        size += len(chunk)
                        if size > limit:
                            raise BatchError(f"the file is over this server's {limit} bytes (limits.max_file_bytes)", status=413)
                        await asyncio.to_thread(writer.write, chunk)
                elif part.name:  # a form field: purpose, expires_after[...]
                    value = await part.read(decode=True)  # type: ignore[union-attr]
                    if len(value) > 4096:
                        raise BatchError(f"form field {part.name!r} is too long", param=part.name)
                    fields[part.name] = value.decode("utf-8", "replace")
        except BatchError:
            raise
        except (ValueError, ConnectionError, asyncio.IncompleteReadError, HttpProcessingError) as exc:
            # aiohttp's multipart reader on a body cut short or without its closing boundary
            raise BatchError(f"the multipart/form-data body is malformed or ended early ({exc})") from None
        if writer is None:
            raise BatchError("no 'file' field in the upload", param="file")
        if fields.get("purpose") != "batch":
            raise BatchError(f"purpose {fields.get('purpose')!r}: this server takes purpose 'batch' only", param="purpose")
        expiry_s = upload_expiry(config, fields)
        await asyncio.to_thread(writer.commit)
    except BaseException:
        if writer is not None:  # nothing of a refused upload stays: neither its bytes nor its folder
            await asyncio.to_thread(writer.discard)
            await asyncio.to_thread(store.remove, store.file_dir(file_id))
        raise
    created = now()
    meta = {"id": file_id, "object": "file", "bytes": size, "created_at": created, "created_ns": time.time_ns(), "filename": filename,
            "purpose": "batch", "status": "processed", "expires_at": None if expiry_s is None else created + expiry_s,
            "status_details": None, "url": url, "project": request[PROJECT]}
    await asyncio.to_thread(store.write_json, file_meta_url(store, file_id), meta)
    return json_response(file_object(meta))


async def list_files(request: web.Request) -> web.Response:
    store = request.app[STORE]
    ids = await asyncio.to_thread(store.children, store.url("files"))
    metas = [m for m in await asyncio.gather(*(asyncio.to_thread(store.read_json, file_meta_url(store, i)) for i in ids if check_id(i, "file")))
             if m is not None and owner(m) == request[PROJECT]]
    if purpose := request.query.get("purpose"):
        metas = [m for m in metas if m["purpose"] == purpose]
    metas.sort(key=lambda m: (m.get("created_ns", 0), m["id"]), reverse=request.query.get("order", "desc") != "asc")
    shown, more = page(metas, limit_of(request, 10_000, 10_000), request.query.get("after"))
    return json_response(listing([file_object(m) for m in shown], more))


async def get_file(request: web.Request) -> web.Response:
    return json_response(file_object(await file_meta(request, request.match_info["file_id"])))


async def file_content(request: web.Request) -> web.StreamResponse:
    meta = await file_meta(request, request.match_info["file_id"])
    store = request.app[STORE]
    try:
        snapshot = await asyncio.to_thread(store.snapshot, meta["url"])
    except FileNotFoundError:  # deleted (or expired) since its meta was read
        raise BatchError(f"No such File object: {meta['id']}", status=404, param="file_id") from None
    try:
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream", "Cache-Control": "no-store"})
        response.content_length = snapshot.size
        await response.prepare(request)
        while chunk := await asyncio.to_thread(snapshot.read):
            await response.write(chunk)
        await response.write_eof()
    finally:
        await asyncio.to_thread(snapshot.close)
    return response


async def remove_file(request: web.Request) -> web.Response:
    meta = await file_meta(request, request.match_info["file_id"])
    await asyncio.to_thread(delete_file, request.app[STORE], meta)
    return json_response({"id": meta["id"], "object": "file", "deleted": True})


def _model_object(request: web.Request, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": request.app[STARTED], "owned_by": "batch-inference"}


async def list_models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": [_model_object(request, n) for n in request.app[CONFIG].models]})


async def get_model(request: web.Request) -> web.Response:
    name, models = request.match_info["model"], request.app[CONFIG].models
    if name not in models:
        raise BatchError(f"The model {name!r} does not exist (configured: {', '.join(models)})", status=404, param="model")
    return json_response(_model_object(request, name))


ROUTES = [
    web.get("/v1/models", list_models),
    web.get("/v1/models/{model}", get_model),
    web.post("/v1/files", upload),
    web.get("/v1/files", list_files),
    web.get("/v1/files/{file_id}", get_file),
    web.delete("/v1/files/{file_id}", remove_file),
    web.get("/v1/files/{file_id}/content", file_content),
]
