"""``GET /health``: the server answers (no key needed)."""

from __future__ import annotations

from aiohttp import web

from batch_inference.api.routes.common import json_response


async def health(request: web.Request) -> web.Response:
    return json_response({"ok": True})


ROUTES = [web.get("/health", health)]
