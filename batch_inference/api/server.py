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
stack trace. This module is the app (keys, errors, lifecycle); the routes are ``api.routes``'
modules, by resource, and a batch's life is ``BatchManager``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from batch_inference.api.batches import BatchError, BatchManager, now
from batch_inference.api.config import ApiConfig
from batch_inference.api.metrics import metrics_route
from batch_inference.api.protocol import owner
from batch_inference.api.routes import ROUTES
from batch_inference.api.routes.common import CONFIG, MANAGER, PROJECT, STARTED, STORE, error_response
from batch_inference.api.store import Store
from batch_inference.api.usage import usage_route

log = logging.getLogger(__name__)

__all__ = ["CONFIG", "MANAGER", "PROJECT", "create_app", "error_response", "owner", "serve"]


def key_checker(keys: dict[str, str]) -> Callable[[web.Request], str | None]:
    """The project of a request's key (None: no key of ``keys``), each key compared in constant time."""
    known = [(key.encode(), project) for key, project in keys.items()]

    def project_of(request: web.Request) -> str | None:
        given = request.headers.get("x-api-key") or ""
        auth = request.headers.get("Authorization", "")
        if not given and auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        # aiohttp decodes header bytes that are not UTF-8 as surrogates: these give the bytes back (they match no key)
        raw = given.encode("utf-8", "surrogateescape")
        found = None
        for key, project in known:  # every key compared, in constant time each: nothing leaks which one nearly matched
            if hmac.compare_digest(raw, key):
                found = project
        return found if given else None

    return project_of


def guard(project_of: Callable[[web.Request], str | None]) -> Any:
    """The middleware: a ``/v1`` call needs a key; every refusal and failure is the calling API's error shape."""

    @web.middleware
    async def middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
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

    return middleware


def create_app(config: ApiConfig, *, tokens: dict[str, str] | None = None) -> web.Application:
    """The API over ``config``'s storage and models; ``tokens``: each accepted key and its project (default: the tokens file's)."""
    store = Store(config.storage, config.storage_options)
    manager = BatchManager(config, store)
    manager.check_models()
    project_of = key_checker(tokens if tokens is not None else config.tokens())
    app = web.Application(middlewares=[guard(project_of)],
                          client_max_size=config.limits.max_request_bytes)
    app[MANAGER], app[CONFIG], app[STORE], app[STARTED] = manager, config, store, now()
    app.router.add_routes(ROUTES)
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
