"""The review page: one record at a time, keyboard verdicts, over a run's open review queues.

``batch-inference review SPEC`` serves it (aiohttp, plain HTML + one small script, no
external assets). The queue, the verdict log and the leases are
:class:`batch_inference.review.queue.ReviewQueue`'s; this module is HTTP around it.

Routes: ``GET /`` (the page), ``GET /static/*``, ``GET /health``; the API, all JSON:
``GET /api/progress`` (done, left, per reviewer, rate, ETA, rounds, reasons; ``?round=``,
``?reason=``), ``POST /api/next`` ``{round?, reason?, skip?}`` -> the next record (leased
to you) or ``{"record": null}``, ``POST /api/verdict`` ``{round, key, verdict, reason?,
edited_result?}`` -> ``{"result": "decided" | "conflict", ...}`` (409 once the round's
review is closed), ``POST /api/release`` ``{round, key}`` (skip), ``POST /api/undo``. A
record is named by its ``key`` (``id`` is taken where no key is given): docs/review.md.

Who reviews: with a reviewers file (``name: token`` per reviewer) every API call needs
``Authorization: Bearer <token>`` and the name comes from the token; without one the
server binds loopback only and every verdict is signed by ``--as`` (default: the OS
user who started it). Off loopback without tokens it refuses to start, and it answers
a request from off loopback 403 unless tokens are configured. Model output is
untrusted: the page renders it with ``textContent`` only, and every response carries a
strict Content-Security-Policy (scripts and styles from this origin only, no inline
code, no frames, no forms, no plugins).
"""

from __future__ import annotations

import asyncio
import getpass
import hmac
import logging
import os
import signal
from importlib import resources
from pathlib import Path
from typing import Any

import orjson
import yaml
from aiohttp import web

from batch_inference._net import is_loopback
from batch_inference.pipeline.spec import PipelineSpec
from batch_inference.review.lifecycle import ReviewClosed
from batch_inference.review.queue import ReviewQueue

log = logging.getLogger(__name__)

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'; object-src 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
STATIC = {"review.js": "application/javascript", "review.css": "text/css"}
REVIEWER = web.RequestKey("reviewer", str)
QUEUE = web.AppKey("queue", ReviewQueue)


def load_reviewers(path: str | Path) -> dict[str, str]:
    """``{token: name}`` from a YAML/JSON mapping ``name: token`` (one entry per reviewer)."""
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{path}: expected a mapping of reviewer name -> token")
    out: dict[str, str] = {}
    for name, token in data.items():
        if not isinstance(token, str) or len(token) < 16:
            raise ValueError(f"{path}: reviewer {name!r}: a token must be a string of at least 16 characters")
        if token in out:
            raise ValueError(f"{path}: reviewers {out[token]!r} and {name!r} share a token")
        out[token] = str(name)
    return out


def _static(name: str) -> bytes:
    return resources.files("batch_inference.review").joinpath("static", name).read_bytes()


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json",
                        headers={"Cache-Control": "no-store"})


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status)


def create_app(queue: ReviewQueue, *, reviewers: dict[str, str] | None = None, default_reviewer: str | None = None,
               refresh_s: float = 5.0) -> web.Application:
    """The page and its API over ``queue``; ``reviewers`` maps token -> name (None: loopback, one identity)."""
    tokens = dict(reviewers or {})
    anonymous = default_reviewer or getpass.getuser()

    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            response = await _guarded(request, handler)
        except web.HTTPException as exc:
            # the API answers JSON, errors included ({"error": ...}: a bad request, an unknown
            # route, a body over the size limit); the page's routes keep aiohttp's own
            api_error = request.path.startswith("/api/") and exc.status >= 400
            response = _error(exc.status, exc.text or exc.reason) if api_error else exc
        response.headers.update(SECURITY_HEADERS)
        return response

    async def _guarded(request: web.Request, handler: Any) -> web.StreamResponse:
        if not tokens and not is_loopback(request.remote):
            log.warning("refused %s %s from %s: off loopback and no reviewer tokens", request.method, request.path, request.remote)
            return _error(403, "this review server has no reviewer tokens: it serves loopback only")
        host = request.host.rsplit(":", 1)[0].strip("[]")
        if not tokens and not is_loopback(host):  # DNS rebinding: a loopback server is only ever asked for by a loopback name
            return _error(403, f"unexpected Host {request.host!r}")
        if request.path.startswith("/api/"):
            if tokens:
                given = request.headers.get("Authorization", "")
                name = next((n for t, n in tokens.items() if hmac.compare_digest(given.encode(), f"Bearer {t}".encode())), None)
                if name is None:
                    log.warning("refused %s %s from %s: missing or wrong reviewer token", request.method, request.path, request.remote)
                    return _error(401, "missing or wrong reviewer token")
                request[REVIEWER] = name
            else:
                request[REVIEWER] = anonymous
            if request.method == "POST":
                if request.content_type != "application/json":  # a cross-site form cannot send JSON without a preflight
                    return _error(415, "send application/json")
                origin = request.headers.get("Origin")
                if origin is not None and origin.split("://", 1)[-1] != request.host:
                    return _error(403, f"cross-origin request from {origin!r} refused")
        return await handler(request)

    app = web.Application(middlewares=[guard], client_max_size=256 * 1024)
    app[QUEUE] = queue

    async def index(request: web.Request) -> web.Response:
        return web.Response(body=_static("index.html"), content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-store"})

    async def static(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC:
            raise web.HTTPNotFound()
        return web.Response(body=_static(name), content_type=STATIC[name], charset="utf-8")

    async def health(request: web.Request) -> web.Response:
        return _json({"ok": True, "run": queue.spec.run, "rounds": queue.rounds()})

    def _round(value: Any) -> int | None:
        if value in (None, "", "all"):
            return None
        try:
            return int(value)
        except (TypeError, ValueError):
            raise web.HTTPBadRequest(text=f"round must be a number, got {value!r}") from None

    def _key(data: dict[str, Any]) -> str | None:
        """The queue row a request names: ``key`` as ``/api/next`` gave it, else ``id`` (the same
        for every record whose id the input does not repeat)."""
        value = data.get("key") if data.get("key") is not None else data.get("id")
        return None if value is None else str(value)

    async def body(request: web.Request) -> dict[str, Any]:
        try:
            data = orjson.loads(await request.read() or b"{}")
        except orjson.JSONDecodeError as exc:
            raise web.HTTPBadRequest(text=f"not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise web.HTTPBadRequest(text="expected a JSON object")
        return data

    async def progress(request: web.Request) -> web.Response:
        data = queue.progress(round=_round(request.query.get("round")), reason=request.query.get("reason") or None)
        return _json({**data, "run": queue.spec.run, "you": request[REVIEWER], "lease_s": queue.lease_s})

    async def next_record(request: web.Request) -> web.Response:
        data = await body(request)
        skip = data.get("skip") or []
        if not isinstance(skip, list):
            raise web.HTTPBadRequest(text="skip must be a list of record keys")
        claim = await queue.next(request[REVIEWER], round=_round(data.get("round")), reason=data.get("reason") or None,
                                 skip=[str(s) for s in skip])
        return _json({"record": queue.view(*claim) if claim else None})

    async def verdict(request: web.Request) -> web.Response:
        data = await body(request)
        kind = data.get("verdict")
        if kind not in ("approve", "reject"):
            raise web.HTTPBadRequest(text="verdict must be 'approve' or 'reject'")
        for key in ("reason", "edited_result"):
            if data.get(key) is not None and not isinstance(data[key], str):
                raise web.HTTPBadRequest(text=f"{key} must be a string")
        r, key = _round(data.get("round")), _key(data)
        if r is None or key is None:
            raise web.HTTPBadRequest(text="a verdict needs round and key (or id)")
        try:
            outcome = await queue.decide(request[REVIEWER], r, key, kind, reason=data.get("reason") or None,
                                         edited_result=data.get("edited_result"))
        except ReviewClosed as exc:
            return _error(409, str(exc))
        except KeyError as exc:
            return _error(404, str(exc.args[0]))
        return _json({"result": outcome.result, "entry": outcome.entry, "kept": outcome.kept})

    async def release(request: web.Request) -> web.Response:
        data = await body(request)
        r, key = _round(data.get("round")), _key(data)
        if r is None or key is None:
            raise web.HTTPBadRequest(text="release needs round and key (or id)")
        await queue.release(request[REVIEWER], r, key)
        return _json({"ok": True})

    async def undo(request: web.Request) -> web.Response:
        try:
            claim = await queue.undo(request[REVIEWER])
        except ReviewClosed as exc:
            return _error(409, str(exc))
        return _json({"record": queue.view(*claim) if claim else None})

    async def refresher(app: web.Application) -> Any:
        async def loop() -> None:
            while True:
                await asyncio.sleep(refresh_s)
                try:
                    await queue.refresh()
                except Exception:  # storage hiccup: the next look will do
                    log.exception("review queue refresh failed")

        task = asyncio.create_task(loop())
        yield
        task.cancel()

    app.router.add_get("/", index)
    app.router.add_get("/static/{name}", static)
    app.router.add_get("/health", health)
    app.router.add_get("/api/progress", progress)
    app.router.add_post("/api/next", next_record)
    app.router.add_post("/api/verdict", verdict)
    app.router.add_post("/api/release", release)
    app.router.add_post("/api/undo", undo)
    app.cleanup_ctx.append(refresher)
    return app


def check_bind(host: str, reviewers: dict[str, str] | None) -> None:
    """Off loopback, only with reviewer tokens (raises ``PermissionError``)."""
    if not is_loopback(host) and not reviewers:
        raise PermissionError(f"refusing to bind {host}: off loopback every reviewer needs a token (pass --reviewers FILE)")


async def start(queue: ReviewQueue, host: str, port: int, *, reviewers: dict[str, str] | None = None,
                default_reviewer: str | None = None) -> tuple[web.AppRunner, int]:
    """The review app listening on ``host:port`` (0: any free port): its runner (``cleanup()``
    stops it) and the bound port. Binding is not checked here: ``serve`` checks it first."""
    await queue.refresh()
    runner = web.AppRunner(create_app(queue, reviewers=reviewers, default_reviewer=default_reviewer), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner, runner.addresses[0][1]


async def serve(spec: PipelineSpec, *, host: str = "127.0.0.1", port: int = 8765, reviewers: dict[str, str] | None = None,
                default_reviewer: str | None = None, lease_s: float | None = None, ready: Any = None) -> None:
    """Serve the review page until SIGTERM/SIGINT; ``ready(url)`` is called once listening."""
    check_bind(host, reviewers)
    queue = ReviewQueue(spec, lease_s=lease_s)
    runner, bound = await start(queue, host, port, reviewers=reviewers, default_reviewer=default_reviewer)
    url = f"http://{host}:{bound}/"
    log.info("review page for run %s: %s (pid %d, rounds open: %s)", spec.run, url, os.getpid(), queue.rounds() or "none yet")
    if ready is not None:
        ready(url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
