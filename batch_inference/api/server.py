"""``batch-inference api serve``: OpenAI's and Anthropic's Batch APIs over the pipeline (aiohttp).

Routes (docs/api.md): ``GET /v1/models``; files ``POST/GET /v1/files``, ``GET/DELETE
/v1/files/{id}``, ``GET /v1/files/{id}/content``; batches ``POST/GET /v1/batches``, ``GET
/v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``; Message Batches ``POST/GET
/v1/messages/batches``, ``GET/DELETE /v1/messages/batches/{id}``, ``POST
/v1/messages/batches/{id}/cancel``, ``GET /v1/messages/batches/{id}/results``; ``GET
/v1/organization/usage/completions`` (``api/usage.py``); ``GET /health``, ``GET /metrics``
(``api/metrics.py``).

Every ``/v1`` call needs a key of the tokens file, as ``Authorization: Bearer`` (OpenAI's
SDK) or ``x-api-key`` (Anthropic's), compared in constant time; 401 otherwise. A key belongs
to a project (the tokens file's ``[project]`` lines): every file and batch records the
project that made it, and a key sees only its project's, as OpenAI's project keys do;
another project's id answers 404, exactly as an id that does not exist. Errors are the
calling API's JSON shape (``/v1/messages/...``: Anthropic's, the rest OpenAI's), never a
stack trace. This module is HTTP only: a batch's life is ``BatchManager``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from batch_inference.api import anthropic
from batch_inference.api.batches import BatchError, BatchManager, delete_file, new_id, now
from batch_inference.api.config import DEFAULT_PROJECT, ApiConfig
from batch_inference.api.metrics import metrics_route
from batch_inference.api.store import Store, check_id
from batch_inference.api.usage import usage_route
from batch_inference.prompting.openai_batch import jsonl_line

log = logging.getLogger(__name__)

MANAGER = web.AppKey("manager", BatchManager)
CONFIG = web.AppKey("config", ApiConfig)
CHUNK = 1 << 20
HIDDEN = ("api", "source_url", "stopped", "run", "created_ns", "project", "delivering")  # the state's own keys, not OpenAI's batch fields
FILE_HIDDEN = ("url", "created_ns", "project")  # a file's meta keys that are the server's, not OpenAI's file fields
PROJECT = web.RequestKey("project", str)
MAX_FILE_EXPIRY_S = 30 * 86400  # OpenAI's: expires_after.seconds between 3600 and 2592000


# -- responses -------------------------------------------------------------------------


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json",
                        headers={"Cache-Control": "no-store"})


def _is_anthropic(request: web.Request) -> bool:
    return request.path.startswith("/v1/messages")


ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                   405: "invalid_request_error", 409: "invalid_request_error", 413: "request_too_large", 500: "api_error"}


def error_response(request: web.Request, status: int, message: str, *, param: str | None = None, code: str | None = None) -> web.Response:
    """The error in the calling API's shape."""
    if _is_anthropic(request):
        return _json({"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}, status)
    kind = {401: "invalid_request_error", 404: "invalid_request_error", 500: "server_error"}.get(status, "invalid_request_error")
    return _json({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def _openai_batch(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k not in HIDDEN}


def _file_object(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if k not in FILE_HIDDEN}


def owner(item: dict[str, Any]) -> str:
    """The project a file or batch belongs to: the one recorded, else (made before projects) the default one."""
    return str(item.get("project") or DEFAULT_PROJECT)


def _page(items: list[dict[str, Any]], limit: int, after: str | None, key: str = "id") -> tuple[list[dict[str, Any]], bool]:
    """``limit`` items following the one whose id is ``after`` (the list's own order)."""
    if after is not None:
        ids = [x[key] for x in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    return items[:limit], len(items) > limit


def _limit(request: web.Request, default: int = 20, most: int = 100) -> int:
    raw = request.query.get("limit", str(default))
    try:
        value = int(raw)
    except ValueError:
        raise BatchError(f"limit {raw!r} is not an integer", param="limit") from None
    if not 1 <= value <= most:
        raise BatchError(f"limit {value} must be between 1 and {most}", param="limit")
    return value


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        data = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise BatchError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BatchError("the request body must be a JSON object")
    return data


# -- the app ---------------------------------------------------------------------------


def create_app(config: ApiConfig, *, tokens: dict[str, str] | None = None) -> web.Application:
    """The API over ``config``'s storage and models; ``tokens``: each accepted key and its project (default: the tokens file's)."""
    keys = [(key.encode(), project) for key, project in (tokens if tokens is not None else config.tokens()).items()]
    store = Store(config.storage, config.storage_options)
    manager = BatchManager(config, store)
    manager.check_models()
    started = now()

    def project_of(request: web.Request) -> str | None:
        """The project of the request's key; None when it has no key of ours."""
        given = request.headers.get("x-api-key") or ""
        auth = request.headers.get("Authorization", "")
        if not given and auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        # aiohttp decodes header bytes that are not UTF-8 as surrogates: these give the bytes back (they match no key)
        raw = given.encode("utf-8", "surrogateescape")
        found = None
        for key, project in keys:  # every key compared, in constant time each: nothing leaks which one nearly matched
            if hmac.compare_digest(raw, key):
                found = project
        return found if given else None

    @web.middleware
    async def guard(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.path.startswith("/v1/"):
            project = project_of(request)
            if project is None:
                log.warning("refused %s %s from %s: missing or wrong API key", request.method, request.path, request.remote)
                return error_response(request, 401, "invalid or missing API key (Authorization: Bearer <key>, or x-api-key)",
                                      code="invalid_api_key")
            request[PROJECT] = project
        try:
            return await handler(request)
        except BatchError as exc:
            return error_response(request, exc.status, str(exc), param=exc.param)
        except web.HTTPRequestEntityTooLarge as exc:
            return error_response(request, 413, f"request too large: {exc.text}")
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return error_response(request, exc.status, exc.reason)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return error_response(request, 500, "internal server error (see the server's log)")

    app = web.Application(middlewares=[guard], client_max_size=config.limits.max_request_bytes)
    app[MANAGER], app[CONFIG] = manager, config

    def file_meta_url(file_id: str) -> str:
        return f"{store.file_dir(file_id)}/meta.json"

    async def file_meta(request: web.Request, file_id: str) -> dict[str, Any]:
        """The file ``file_id`` of the caller's project; another project's answers as one that does not exist."""
        meta = await asyncio.to_thread(store.read_json, file_meta_url(file_id)) if check_id(file_id, "file") else None
        if meta is None or owner(meta) != request[PROJECT]:
            raise BatchError(f"No such File object: {file_id}", status=404, param="file_id")
        return meta

    async def batch_state(request: web.Request, batch_id: str, prefix: str) -> dict[str, Any]:
        """The batch ``batch_id`` of the caller's project; another project's answers as one that does not exist."""
        state = await manager.get(batch_id) if check_id(batch_id, prefix) else None
        if state is None or state["api"] != ("anthropic" if prefix == "msgbatch" else "openai") or owner(state) != request[PROJECT]:
            raise BatchError(f"No such batch: {batch_id}", status=404)
        return state

    async def own_batches(request: web.Request, api: str) -> list[dict[str, Any]]:
        """The caller's project's batches of ``api``, newest first."""
        return [s for s in await manager.all() if s["api"] == api and owner(s) == request[PROJECT]]

    # -- models ---------------------------------------------------------------------

    def model_object(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": started, "owned_by": "batch-inference"}

    async def list_models(request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [model_object(n) for n in config.models]})

    async def get_model(request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in config.models:
            raise BatchError(f"The model {name!r} does not exist (configured: {', '.join(config.models)})", status=404, param="model")
        return _json(model_object(name))

    # -- files ----------------------------------------------------------------------

    async def upload(request: web.Request) -> web.Response:
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
            expiry_s = upload_expiry(fields)
            await asyncio.to_thread(writer.commit)
        except BaseException:
            if writer is not None:  # nothing of a refused upload stays: neither its bytes nor its folder
                await asyncio.to_thread(writer.discard)
                await asyncio.to_thread(store.remove, store.file_dir(file_id))
            raise
        created = now()
        meta = {"id": file_id, "object": "file", "bytes": size, "created_at": created, "created_ns": time.time_ns(), "filename": filename, "purpose": "batch",
                "status": "processed", "expires_at": None if expiry_s is None else created + expiry_s, "status_details": None, "url": url, "project": request[PROJECT]}
        await asyncio.to_thread(store.write_json, file_meta_url(file_id), meta)
        return _json(_file_object(meta))

    def upload_expiry(fields: dict[str, str]) -> int | None:
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

    async def list_files(request: web.Request) -> web.Response:
        ids = await asyncio.to_thread(store.children, store.url("files"))
        metas = [m for m in await asyncio.gather(*(asyncio.to_thread(store.read_json, file_meta_url(i)) for i in ids if check_id(i, "file")))
                 if m is not None and owner(m) == request[PROJECT]]
        if purpose := request.query.get("purpose"):
            metas = [m for m in metas if m["purpose"] == purpose]
        metas.sort(key=lambda m: (m.get("created_ns", 0), m["id"]), reverse=request.query.get("order", "desc") != "asc")
        page, more = _page(metas, _limit(request, 10_000, 10_000), request.query.get("after"))
        return _json({"object": "list", "data": [_file_object(m) for m in page], "has_more": more,
                      "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None})

    async def get_file(request: web.Request) -> web.Response:
        return _json(_file_object(await file_meta(request, request.match_info["file_id"])))

    async def file_content(request: web.Request) -> web.StreamResponse:
        meta = await file_meta(request, request.match_info["file_id"])
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
        await asyncio.to_thread(delete_file, store, meta)
        return _json({"id": meta["id"], "object": "file", "deleted": True})

    # -- OpenAI batches -----------------------------------------------------------------

    async def create_batch(request: web.Request) -> web.Response:
        body = await _body(request)
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
                    and config.limits.min_output_expiry_s <= seconds <= 30 * 86400):
                raise BatchError(f"output_expires_after: {{anchor: created_at, seconds}} with seconds between "
                                 f"{int(config.limits.min_output_expiry_s)} and {30 * 86400}", param="output_expires_after")
        state = await manager.create(api="openai", endpoint=str(body.get("endpoint")), source_url=meta["url"], input_file_id=file_id,
                                     window=window, window_s=window_s, metadata=metadata, output_expires_after=expiry,
                                     project=request[PROJECT])
        return _json(_openai_batch(state))

    async def get_batch(request: web.Request) -> web.Response:
        return _json(_openai_batch(await batch_state(request, request.match_info["batch_id"], "batch")))

    async def list_batches(request: web.Request) -> web.Response:
        states = await own_batches(request, "openai")
        page, more = _page(states, _limit(request), request.query.get("after"))
        return _json({"object": "list", "data": [_openai_batch(s) for s in page], "has_more": more,
                      "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None})

    async def cancel_batch(request: web.Request) -> web.Response:
        state = await batch_state(request, request.match_info["batch_id"], "batch")
        return _json(_openai_batch(await manager.cancel(state["id"])))

    # -- Anthropic Message Batches ----------------------------------------------------------

    def results_url(request: web.Request, batch_id: str) -> str:
        base = (config.base_url or f"{request.scheme}://{request.host}").rstrip("/")
        return f"{base}/v1/messages/batches/{batch_id}/results"

    async def create_message_batch(request: web.Request) -> web.Response:
        body = await _body(request)
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
        state = await manager.create(api="anthropic", endpoint="/v1/chat/completions", source_url=source, input_file_id=None,
                                     window=f"{int(config.limits.anthropic_window)}s", window_s=config.limits.anthropic_window,
                                     metadata=None, output_expires_after=None, batch_id=batch_id, project=request[PROJECT])
        return _json(anthropic.batch_object(state, results_url(request, batch_id)))

    async def get_message_batch(request: web.Request) -> web.Response:
        state = await batch_state(request, request.match_info["batch_id"], "msgbatch")
        return _json(anthropic.batch_object(state, results_url(request, state["id"])))

    async def list_message_batches(request: web.Request) -> web.Response:
        states = await own_batches(request, "anthropic")
        limit = _limit(request)
        if before := request.query.get("before_id"):
            ids = [s["id"] for s in states]
            states = states[:ids.index(before)] if before in ids else []
            more = len(states) > limit
            page = states[-limit:]
        else:
            page, more = _page(states, limit, request.query.get("after_id"))
        return _json({"data": [anthropic.batch_object(s, results_url(request, s["id"])) for s in page], "has_more": more,
                      "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None})

    async def cancel_message_batch(request: web.Request) -> web.Response:
        state = await batch_state(request, request.match_info["batch_id"], "msgbatch")
        state = await manager.cancel(state["id"]) if state["status"] in ("validating", "in_progress") else state
        return _json(anthropic.batch_object(state, results_url(request, state["id"])))

    async def delete_message_batch(request: web.Request) -> web.Response:
        state = await batch_state(request, request.match_info["batch_id"], "msgbatch")
        if state["status"] not in ("completed", "failed", "expired", "cancelled"):
            raise BatchError(f"batch {state['id']} is still processing: cancel it, and delete it once it has ended", status=409)
        await asyncio.to_thread(manager.delete, state)
        return _json({"id": state["id"], "type": "message_batch_deleted"})

    async def message_batch_results(request: web.Request) -> web.StreamResponse:
        state = await batch_state(request, request.match_info["batch_id"], "msgbatch")
        if state["status"] not in ("completed", "failed", "expired", "cancelled"):
            raise BatchError(f"batch {state['id']} has not ended: its results are not ready", status=404)
        urls = []
        for file_id in (state.get("output_file_id"), state.get("error_file_id")):
            if file_id:
                urls.append((await file_meta(request, file_id))["url"])
        response = web.StreamResponse(headers={"Content-Type": "application/binary", "Cache-Control": "no-store"})
        await response.prepare(request)
        for url in urls:
            lines = store.lines(url)
            while (raw := await asyncio.to_thread(next, lines, None)) is not None:
                if raw.strip():
                    await response.write(jsonl_line(anthropic.result_line(orjson.loads(raw))))
        await response.write_eof()
        return response

    async def health(request: web.Request) -> web.Response:
        return _json({"ok": True})

    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_post("/v1/files", upload)
    app.router.add_get("/v1/files", list_files)
    app.router.add_get("/v1/files/{file_id}", get_file)
    app.router.add_delete("/v1/files/{file_id}", remove_file)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", get_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)
    app.router.add_post("/v1/messages/batches", create_message_batch)
    app.router.add_get("/v1/messages/batches", list_message_batches)
    app.router.add_get("/v1/messages/batches/{batch_id}", get_message_batch)
    app.router.add_delete("/v1/messages/batches/{batch_id}", delete_message_batch)
    app.router.add_post("/v1/messages/batches/{batch_id}/cancel", cancel_message_batch)
    app.router.add_get("/v1/messages/batches/{batch_id}/results", message_batch_results)
    # usage per project and Prometheus metrics (api/usage.py, api/metrics.py)
    app.router.add_get("/v1/organization/usage/completions", usage_route(manager.usage, PROJECT, config.admin_project))
    app.router.add_get("/metrics", metrics_route(manager, lambda r: config.admin_project is None or project_of(r) == config.admin_project))

    async def lifecycle(app: web.Application) -> Any:
        await manager.resume_all()
        ticker = asyncio.create_task(_tick_forever(manager, config.tick_s))
        yield
        ticker.cancel()
        await asyncio.gather(ticker, return_exceptions=True)
        await manager.close()

    app.cleanup_ctx.append(lifecycle)
    return app


async def _tick_forever(manager: BatchManager, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        try:
            await manager.tick()
        except Exception:
            log.exception("batch tick failed (retried at the next)")


async def serve(config: ApiConfig, *, host: str = "127.0.0.1", port: int = 8080,
                ready: Callable[[str], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM; batches left running resume at the next start."""
    app = create_app(config)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1] if site._server and site._server.sockets else port  # type: ignore[union-attr]
    if ready is not None:
        ready(f"http://{host}:{bound}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
