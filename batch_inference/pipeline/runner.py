"""The TaskRunner a spec asks for: in this process, a running pool, or a launched one.

The pipeline only ever sees the ``TaskRunner`` protocol (``limit``, ``run_task``); this
module is the one place that maps ``spec.pool`` onto the pool layer's classes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from batch_inference.pipeline.spec import PipelineSpec
from batch_inference.pool.protocol import TaskRunner


@asynccontextmanager
async def open_runner(spec: PipelineSpec) -> AsyncIterator[TaskRunner]:
    """``async with open_runner(spec) as runner``: the runner ``spec.pool`` describes.

    * ``endpoints`` given: a client to that running pool (it outlives this run).
    * ``launcher: inprocess``: the worker's task code in this process (tests, small runs).
    * ``launcher: local`` / ``k8s``: the launcher brings the pool up (reusing a running
      one) and a client drives it; the pool is left running for the next run, as the
      reference's reusable containers are (its idle TTL shuts it down).
    """
    pool = spec.pool
    profiles = {pool.storage_options_ref: spec.storage_options} if pool.storage_options_ref else None
    if not pool.endpoints and pool.launcher == "inprocess":
        from batch_inference.pool import InProcessPool

        async with InProcessPool(
            spec.engine, concurrency=pool.concurrency * pool.replicas, batcher=pool.batcher or None,
            retries=pool.retries, storage_profiles=profiles, checkpoint_interval_s=pool.checkpoint_interval_s,
        ) as runner:
            yield runner
        return
    endpoints = list(pool.endpoints)
    if not endpoints:
        endpoints = await _launch(spec)
    from batch_inference.pool import PoolClient

    client = PoolClient(
        endpoints, concurrency=pool.concurrency, retries=pool.retries, timeout_s=pool.timeout_s, token=spec.pool_token()
    )
    async with client:
        yield client


async def _launch(spec: PipelineSpec) -> list[str]:
    """Bring up (or find) the pool the spec's launcher manages; return its endpoints."""
    import asyncio

    pool = spec.pool
    if pool.launcher == "local":
        from batch_inference.pool import LocalLauncher

        launcher = LocalLauncher(spec.engine, replicas=pool.replicas, concurrency=pool.concurrency, batcher=pool.batcher or None)
    else:
        from batch_inference.pool import K8sLauncher

        launcher = K8sLauncher(spec.engine, replicas=pool.replicas, concurrency=pool.concurrency)
    await asyncio.to_thread(launcher.up)
    return list(launcher.endpoints())
