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

Two resources of this class: ``pool`` (role ``infer``) points ``spec.pool`` at its pool,
``judge_pool`` (role ``judge``) points a judge's own pool (``judge.pool``, for a judge
with its own ``judge.engine``) at its pool; a spec whose judge has no engine of its own
runs its judge on ``pool`` and ignores ``judge_pool``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import dagster as dg
from pydantic import Field

if TYPE_CHECKING:
    from batch_inference.pipeline import PipelineSpec

PoolMode = Literal["spec", "inprocess", "local", "endpoints"]


class PoolResource(dg.ConfigurableResource):
    """How GPU steps reach the worker pool (see the module docstring for the modes)."""

    mode: PoolMode = "spec"
    role: Literal["infer", "judge"] = Field("infer", description="infer: the spec's pool; judge: the judge's own pool (judge.pool)")
    endpoints: list[str] = Field(default_factory=list, description="worker URLs (http://host:port) for local/endpoints modes")
    token_env: str | None = Field(None, description="env var holding the workers' bearer token")
    concurrency: int | None = Field(None, ge=1, description="override the spec's per-worker concurrency")
    replicas: int | None = Field(None, ge=1, description="override the spec's replica count (local/inprocess)")
    storage_options_ref: str | None = Field(None, description="storage profile name in the workers' own config")
    batcher: dict[str, Any] = Field(default_factory=dict, description="override the spec's batcher options")

    def apply(self, spec: PipelineSpec) -> PipelineSpec:
        """``spec`` with this resource's pool section (``pool``, or ``judge.pool``) pointed at its pool."""
        if self.mode == "spec" or (self.role == "judge" and spec.judge_pool is None):
            return spec
        update: dict[str, Any] = {"launcher": "local" if self.mode == "endpoints" else self.mode}
        if self.mode in ("local", "endpoints"):
            if self.mode == "endpoints" and not self.endpoints:
                raise ValueError(f"{self.key} mode 'endpoints' needs at least one endpoint ({self.env_prefix}_ENDPOINTS)")
            update["endpoints"] = list(self.endpoints)
        for name in ("token_env", "concurrency", "replicas", "storage_options_ref"):
            value = getattr(self, name)
            if value is not None:
                update[name] = value
        if self.role == "judge":
            assert spec.judge_pool is not None
            if self.batcher:
                update["batcher"] = {**spec.judge_pool.batcher, **self.batcher}
            given = spec.judge.pool.model_dump(include=spec.judge.pool.model_fields_set) if spec.judge.pool else {}
            if self.mode == "inprocess":  # an in-process judge pool takes no endpoints
                given.pop("endpoints", None)
            judge = spec.judge.model_dump(mode="json")
            judge["pool"] = {**given, **update}
            return type(spec).parse({**spec.model_dump(mode="json"), "judge": judge})
        if self.batcher:
            update["batcher"] = {**spec.pool.batcher, **self.batcher}
        pool = spec.pool.model_copy(update=update)
        return spec.model_copy(update={"pool": type(spec.pool).model_validate(pool.model_dump())})

    @property
    def key(self) -> str:
        return "judge_pool" if self.role == "judge" else "pool"

    @property
    def env_prefix(self) -> str:
        return "BATCH_INFERENCE_JUDGE_POOL" if self.role == "judge" else "BATCH_INFERENCE_POOL"

    def describe(self, spec: PipelineSpec) -> dict[str, Any]:
        """Where the tasks ran, for materialisation metadata (a judge pool's under ``judge_pool.*``)."""
        placed = self.apply(spec)
        pool = placed.judge_pool if self.role == "judge" else placed.pool
        if pool is None:  # the judge shares the infer pool
            return {}
        return {f"{self.key}.mode": self.mode, f"{self.key}.name": pool.name, f"{self.key}.launcher": pool.launcher,
                f"{self.key}.endpoints": len(pool.endpoints), f"{self.key}.concurrency": pool.concurrency,
                f"{self.key}.replicas": pool.replicas}
