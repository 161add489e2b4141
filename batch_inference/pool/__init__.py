"""The persistent worker pool: workers that load a model once and serve many shard tasks.

Names are imported lazily so that ``from batch_inference.pool import TaskSpec`` does not
pull in aiohttp or an engine.
"""

from __future__ import annotations

from batch_inference._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "dispatch_bounded": "batch_inference.pool.dispatch",
    "TaskSpec": "batch_inference.pool.protocol",
    "TaskResult": "batch_inference.pool.protocol",
    "TaskConflict": "batch_inference.pool.protocol",
    "TaskFailed": "batch_inference.pool.protocol",
    "TaskRunner": "batch_inference.pool.protocol",
    "InferConfig": "batch_inference.pool.protocol",
    "SamplingConfig": "batch_inference.pool.protocol",
    "derive_seed": "batch_inference.pool.protocol",
    "InProcessPool": "batch_inference.pool.inprocess",
    "PoolClient": "batch_inference.pool.client",
    "LocalLauncher": "batch_inference.pool.launchers.local",
    "K8sLauncher": "batch_inference.pool.launchers.k8s",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
