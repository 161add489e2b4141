"""The pool domain's definitions: the ``pool`` resource, from the environment unless given.

    BATCH_INFERENCE_POOL_MODE        spec | inprocess | local | endpoints   (default: spec)
    BATCH_INFERENCE_POOL_ENDPOINTS   comma-separated worker URLs (endpoints/local modes)
    BATCH_INFERENCE_POOL_TOKEN_ENV   name of the env var holding the workers' bearer token
"""

from __future__ import annotations

import os

import dagster as dg

from batch_inference.defs.pool.resources import PoolResource


def pool_from_env(env: os._Environ[str] | dict[str, str] = os.environ) -> PoolResource:
    endpoints = [e.strip() for e in env.get("BATCH_INFERENCE_POOL_ENDPOINTS", "").split(",") if e.strip()]
    return PoolResource(mode=env.get("BATCH_INFERENCE_POOL_MODE", "spec"), endpoints=endpoints,  # type: ignore[arg-type]
                        token_env=env.get("BATCH_INFERENCE_POOL_TOKEN_ENV") or None)


def build_definitions(pool: PoolResource | None = None) -> dg.Definitions:
    return dg.Definitions(resources={"pool": pool or pool_from_env()})
