"""The pool domain's definitions: the ``pool`` resource, from the environment unless given.

    BATCH_INFERENCE_POOL_MODE        spec | inprocess | local | endpoints   (default: spec)
    BATCH_INFERENCE_POOL_ENDPOINTS   comma-separated worker URLs (endpoints/local modes)
    BATCH_INFERENCE_POOL_TOKEN_ENV   name of the env var holding the workers' bearer token

and the ``judge_pool`` resource (a judge with its own model: its own pool) from the same
variables named ``BATCH_INFERENCE_JUDGE_POOL_*``.
"""

from __future__ import annotations

import os

import dagster as dg

from batch_inference.defs.pool.resources import PoolResource


def pool_from_env(env: os._Environ[str] | dict[str, str] = os.environ, *, role: str = "infer") -> PoolResource:
    prefix = "BATCH_INFERENCE_JUDGE_POOL" if role == "judge" else "BATCH_INFERENCE_POOL"
    endpoints = [e.strip() for e in env.get(f"{prefix}_ENDPOINTS", "").split(",") if e.strip()]
    return PoolResource(mode=env.get(f"{prefix}_MODE", "spec"), role=role, endpoints=endpoints,  # type: ignore[arg-type]
                        token_env=env.get(f"{prefix}_TOKEN_ENV") or None)


def build_definitions(pool: PoolResource | None = None, judge_pool: PoolResource | None = None) -> dg.Definitions:
    if judge_pool is not None and judge_pool.role != "judge":
        raise ValueError("judge_pool: a PoolResource with role 'judge'")
    return dg.Definitions(resources={"pool": pool or pool_from_env(),
                                     "judge_pool": judge_pool or pool_from_env(role="judge")})
