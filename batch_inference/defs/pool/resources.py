"""The Dagster resource that reaches the persistent worker pool.

Dagster sets a resource up per step process (the multiprocess executor) or per pod
(Kubernetes), so a model loaded *by* a resource would be reloaded every step. The pool
therefore lives outside Dagster runs, and this resource only says how to reach it; the
pipeline's ``open_runner`` turns that into a ``TaskRunner``:

- ``spec``       use the pool section of each run's own spec (the default)
- ``local``      the persistent local pool (``batch-inference pool up``): connected to at
                 ``endpoints`` when given, else the local launcher finds the running
                 pool or starts it, and leaves it running after the step
- ``endpoints``  any running pool (Kubernetes Service, remote hosts) at ``endpoints``
- ``inprocess``  the worker code inside the step process: tests and the demo
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Literal

import dagster as dg
from pydantic import Field

if TYPE_CHECKING:
    from batch_inference.pipeline import PipelineSpec
    from batch_inference.pool import TaskRunner

PoolMode = Literal["spec", "inprocess", "local", "endpoints"]


class PoolResource(dg.ConfigurableResource):
    """How GPU steps reach the worker pool (see the module docstring for the modes)."""

    mode: PoolMode = "spec"
    endpoints: list[str] = Field(default_factory=list, description="worker URLs (http://host:port) for local/endpoints modes")
    token_env: str | None = Field(None, description="env var holding the workers' bearer token")
    concurrency: int | None = Field(None, ge=1, description="override the spec's per-worker concurrency")
    replicas: int | None = Field(None, ge=1, description="override the spec's replica count (local/inprocess)")
    storage_options_ref: str | None = Field(None, description="storage profile name in the workers' own config")
    batcher: dict[str, Any] = Field(default_factory=dict, description="override the spec's batcher options")

    def apply(self, spec: PipelineSpec) -> PipelineSpec:
        """``spec`` with its pool section pointed at this resource's pool."""
        if self.mode == "spec":
            return spec
        update: dict[str, Any] = {"launcher": "local" if self.mode == "endpoints" else self.mode}
        if self.mode in ("local", "endpoints"):
            if self.mode == "endpoints" and not self.endpoints:
                raise ValueError("pool mode 'endpoints' needs at least one endpoint (BATCH_INFERENCE_POOL_ENDPOINTS)")
            update["endpoints"] = list(self.endpoints)
        for name in ("token_env", "concurrency", "replicas", "storage_options_ref"):
            value = getattr(self, name)
            if value is not None:
                update[name] = value
        if self.batcher:
            update["batcher"] = {**spec.pool.batcher, **self.batcher}
        pool = spec.pool.model_copy(update=update)
        return spec.model_copy(update={"pool": type(spec.pool).model_validate(pool.model_dump())})

    @asynccontextmanager
    async def runner(self, spec: PipelineSpec) -> AsyncIterator[TaskRunner]:
        """A TaskRunner for ``spec``'s GPU steps, released when the step ends."""
        from batch_inference.pipeline import open_runner

        async with open_runner(self.apply(spec)) as runner:
            yield runner

    def describe(self, spec: PipelineSpec) -> dict[str, Any]:
        """Where the tasks ran, for materialisation metadata."""
        pool = self.apply(spec).pool
        return {"pool.mode": self.mode, "pool.launcher": pool.launcher, "pool.endpoints": len(pool.endpoints),
                "pool.concurrency": pool.concurrency, "pool.replicas": pool.replicas}
