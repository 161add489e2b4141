"""The server's routes by resource, each module a route table (``ROUTES``)."""

from __future__ import annotations

from aiohttp import web

from batch_inference.api.routes import batches, files, health, messages

ROUTES: list[web.RouteDef] = [*health.ROUTES, *files.ROUTES, *batches.ROUTES, *messages.ROUTES]
