"""The TaskRunner a spec asks for: in this process, a running pool, or a launched one.

The pipeline only ever sees the ``TaskRunner`` protocol (``limit``, ``run_task``); this
module is the one place that maps ``spec.pool`` (and a judge's own ``judge.pool``) onto
the pool layer's classes.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from batch_inference.engines import EngineConfig
from batch_inference.pipeline.spec import PipelineSpec, PoolSpec
from batch_inference.pool.protocol import TaskResult, TaskRunner, TaskSpec


class PoolPair:
    """The runner of a run whose judge has a model of its own: two persistent pools.

    ``for_phase`` names the pool a phase runs on: the judge phase on the judge pool,
    infer and the tail on the infer pool (whose retry tasks send their judge waves to the
    judge pool themselves, ``pool.judging.PoolJudging``). As a ``TaskRunner`` it routes each
    task the same way, at most each pool's own ``limit`` in flight there.
    """

    def __init__(self, infer: TaskRunner, judge: TaskRunner) -> None:
        self.infer, self.judge = infer, judge
        self._slots = {"infer": asyncio.Semaphore(max(1, infer.limit)), "judge": asyncio.Semaphore(max(1, judge.limit))}

    def for_phase(self, kind: str) -> TaskRunner:
        """The pool phase ``kind`` (infer | judge | tail, or a task kind) runs on."""
        return self.judge if kind == "judge" else self.infer

    @property
    def limit(self) -> int:
        return max(self.infer.limit, self.judge.limit)

    @property
    def retried(self) -> int:
        return self.infer.retried + self.judge.retried

    async def run_task(self, spec: TaskSpec) -> TaskResult:
        role = "judge" if spec.kind == "judge" else "infer"
        async with self._slots[role]:
            return await self.for_phase(spec.kind).run_task(spec)

    async def stats(self) -> dict[str, Any]:
        """Each pool's own figures, by role."""
        return {"infer": await self.infer.stats(), "judge": await self.judge.stats()}


@asynccontextmanager
async def open_runner(spec: PipelineSpec, *, k8s_api: Any = None) -> AsyncIterator[TaskRunner]:
    """``async with open_runner(spec) as runner``: the runner ``spec.pool`` describes.

    When the judge has an engine of its own (``judge.engine``) this is a ``PoolPair``:
    the judge pool (``spec.judge_pool``) is opened first, then the infer pool, wired to
    reach it (in process: the pool object; local workers: ``--judge-endpoint``, for the
    strategies with an in-place tail). Each pool is opened as below.

    * ``endpoints`` given: a client to that running pool (for ``k8s`` too: an override).
    * ``launcher: k8s``: ``K8sLauncher`` discovers the ready pods of the deployed pool
      ``k8s_name`` in ``namespace`` (one endpoint per worker, so least-loaded choice and
      retry-elsewhere work), waiting up to ``ready_timeout_s`` for ``replicas`` of them.
      ``k8s_api`` is a CoreV1Api-like object (default: in-cluster config or kubeconfig).
    * ``launcher: inprocess``: the worker's task code in this process (tests, small runs).
    * ``launcher: local``: ``LocalLauncher`` brings the pool up, attaching to a running one
      of the same name that fits the spec (``pool up``'s: same engine, batcher and judge
      pool, storage roots that hold the run's; a misfit is replaced, with a warning naming
      what differs), and restarts dead workers on demand; the pool is
      left running for the next run (its ``idle_ttl_s`` shuts it down), as the
      reference's reusable containers are.
    """
    judge_pool = spec.judge_pool
    if judge_pool is None:
        async with _open_pool(spec, spec.pool, spec.engine, k8s_api=k8s_api) as runner:
            yield runner
        return
    async with _open_pool(spec, judge_pool, spec.judge_engine, k8s_api=k8s_api) as judge:
        async with _open_pool(spec, spec.pool, spec.engine, k8s_api=k8s_api, judge=judge) as infer:
            yield PoolPair(infer, judge)


@asynccontextmanager
async def _open_pool(spec: PipelineSpec, pool: PoolSpec, engine: EngineConfig, *, k8s_api: Any = None,
                     judge: TaskRunner | None = None) -> AsyncIterator[TaskRunner]:
    """One pool of ``pool`` running ``engine``; ``judge``: the judge pool its retry tasks reach."""
    token = spec.pool_token(pool)
    if pool.endpoints:
        from batch_inference.pool import PoolClient

        async with PoolClient(pool.endpoints, concurrency=pool.concurrency, retries=pool.retries,
                              timeout_s=pool.timeout_s, token=token) as client:
            yield client
        return
    if pool.launcher == "k8s":
        from batch_inference.pool import K8sLauncher

        # discovery only: nothing is rendered or applied, so no image is needed
        launcher = K8sLauncher(engine, image="", name=pool.k8s_name, namespace=pool.namespace,
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
            engine, concurrency=pool.concurrency * pool.replicas, batcher=pool.batcher or None,
            retries=pool.retries, storage_profiles=profiles, checkpoint_interval_s=pool.checkpoint_interval_s,
            judge_runner=judge,
        ) as runner:
            yield runner
        return
    from batch_inference.pool import LocalLauncher

    # the spec's own rule judge ("module:fn") may be imported by the workers this run starts
    rule = spec.judge.callable if spec.judge.kind == "rule" and ":" in (spec.judge.callable or "") else None
    # Only a run with an in-place tail needs its infer workers to reach the judge pool; a
    # rounds run leaves their configuration (and so a running pool's reuse) as it is.
    judge_endpoints = list(getattr(judge, "endpoints", []) or []) if judge is not None and spec.strategy != "rounds" else []
    launcher = LocalLauncher(
        engine, replicas=pool.replicas, concurrency=pool.concurrency, batcher=pool.batcher or None,
        storage_roots=pool.storage_roots or default_roots(spec), idle_ttl_s=pool.idle_ttl_s, name=pool.name,
        storage_profiles_file=pool.storage_profiles_file, rule_modules=[rule.partition(":")[0]] if rule else None,
        judge_endpoints=judge_endpoints, adopt=True,
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
    roots = [spec.output if "://" in spec.output else os.path.abspath(spec.output), src]
    cache = spec.result_cache_url
    if cache is not None and spec.cache.url is not None:  # a result cache outside the output (docs/cache.md)
        roots.append(cache if "://" in cache else os.path.abspath(cache))
    return roots
