"""The TaskRunner a spec asks for: in this process, a running pool, or a launched one.

The pipeline only ever sees the ``TaskRunner`` protocol (``limit``, ``run_task``); this
module is the one place that maps ``spec.pool`` onto the pool layer's classes.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from batch_inference.pipeline.spec import PipelineSpec
from batch_inference.pool.protocol import TaskRunner


@asynccontextmanager
async def open_runner(spec: PipelineSpec, *, k8s_api: Any = None) -> AsyncIterator[TaskRunner]:
    """``async with open_runner(spec) as runner``: the runner ``spec.pool`` describes.

    * ``endpoints`` given: a client to that running pool (for ``k8s`` too: an override).
    * ``launcher: k8s``: ``K8sLauncher`` discovers the ready pods of the deployed pool
      ``k8s_name`` in ``namespace`` (one endpoint per worker, so least-loaded choice and
      retry-elsewhere work), waiting up to ``ready_timeout_s`` for ``replicas`` of them.
      ``k8s_api`` is a CoreV1Api-like object (default: in-cluster config or kubeconfig).
    * ``launcher: inprocess``: the worker's task code in this process (tests, small runs).
    * ``launcher: local``: ``LocalLauncher`` brings the pool up, reusing a running one of
      the same name and configuration, and restarts dead workers on demand; the pool is
      left running for the next run (its ``idle_ttl_s`` shuts it down), as the
      reference's reusable containers are.
    """
    pool = spec.pool
    token = spec.pool_token()
    if pool.endpoints:
        from batch_inference.pool import PoolClient

        async with PoolClient(pool.endpoints, concurrency=pool.concurrency, retries=pool.retries,
                              timeout_s=pool.timeout_s, token=token) as client:
            yield client
        return
    if pool.launcher == "k8s":
        from batch_inference.pool import K8sLauncher

        # discovery only: nothing is rendered or applied, so no image is needed
        launcher = K8sLauncher(spec.engine, image="", name=pool.k8s_name, namespace=pool.namespace,
                               concurrency=pool.concurrency, token=token, apps_api=k8s_api, core_api=k8s_api)
        await asyncio.to_thread(launcher.wait_ready, replicas=pool.replicas, wait_s=pool.ready_timeout_s)
        client = await asyncio.to_thread(launcher.client, retries=pool.retries, timeout_s=pool.timeout_s)
        async with client:
            yield client
        return
    if pool.launcher == "inprocess":
        from batch_inference.pool import InProcessPool

        # The driver's credentials are this process's too: a task that names no profile
        # gets them as the worker's "default" profile (WorkerRuntime.storage_options).
        profiles = {pool.storage_options_ref or "default": spec.storage_options}
        async with InProcessPool(
            spec.engine, concurrency=pool.concurrency * pool.replicas, batcher=pool.batcher or None,
            retries=pool.retries, storage_profiles=profiles, checkpoint_interval_s=pool.checkpoint_interval_s,
        ) as runner:
            yield runner
        return
    from batch_inference.pool import LocalLauncher

    # the spec's own rule judge ("module:fn") may be imported by the workers this run starts
    rule = spec.judge.callable if spec.judge.kind == "rule" and ":" in (spec.judge.callable or "") else None
    launcher = LocalLauncher(
        spec.engine, replicas=pool.replicas, concurrency=pool.concurrency, batcher=pool.batcher or None,
        storage_roots=pool.storage_roots or default_roots(spec), idle_ttl_s=pool.idle_ttl_s, name=pool.name,
        storage_profiles_file=pool.storage_profiles_file, rule_modules=[rule.partition(":")[0]] if rule else None,
    )
    client = await asyncio.to_thread(launcher.client, retries=pool.retries, timeout_s=pool.timeout_s, token=token)
    async with client:
        yield client


def default_roots(spec: PipelineSpec) -> list[str]:
    """What workers may touch: the run's output base and the input (its folder for a file)."""
    src = spec.input
    if "://" not in src:
        src = os.path.abspath(src)
        if not os.path.isdir(src):
            src = os.path.dirname(src)
    return [spec.output if "://" in spec.output else os.path.abspath(spec.output), src]
