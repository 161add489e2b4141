"""Batches as Dagster runs of the pipeline, on the instance the config's ``dagster.home`` names.

Without ``dagster:`` a batch is ``run_pipeline`` in this process (the embedded default).
With it, each batch's steps run as the pipeline's own Dagster jobs, executed in this
process on that instance, exactly as ``defs.driver`` does for the demo: the start job
records ``api/<model>/source_dataset[<batch id>]`` with the spec, then the round sensor is
ticked and each job it requests for the batch's partitions (shard, rounds, tail, results)
runs in process. A ``dagster dev`` over the same DAGSTER_HOME shows each batch as these
runs, with its lineage, materialisations and checks.

The GPU steps dispatch through the batch's share of its model's pool (``FairShare``, on the
server's event loop): the pipeline's ``pool`` resource in the definitions this server executes
is a ``defs.steps.HostedPool`` that hands each hosted batch's bridge to its steps, so no step
loads the model again, and
batches still share the pool round-robin. The BatchManager keeps the lifecycle: a stop
(cancel, expiry) makes every new task of the batch fail before dispatch and cancels those in
flight, so the running step fails and the sensor requests nothing more.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import dagster as dg

    from batch_inference.defs.keys import PipelineKeys
    from batch_inference.defs.steps import HostedPool
    from batch_inference.pool.protocol import TaskResult, TaskRunner, TaskSpec

log = logging.getLogger(__name__)


class BatchStopped(RuntimeError):
    """The batch was cancelled or expired: its step stops (never a shard's fault: nothing is quarantined)."""


class ThreadBridge:
    """A ``TaskRunner`` for a step's event loop (a Dagster step thread) that runs each task on
    ``inner``, which lives on the server's loop ``loop``."""

    def __init__(self, inner: TaskRunner, loop: asyncio.AbstractEventLoop) -> None:
        self.inner, self.loop = inner, loop
        self.stopped = threading.Event()
        self._inflight: set[concurrent.futures.Future[Any]] = set()
        self._lock = threading.Lock()

    @property
    def limit(self) -> int:
        return self.inner.limit

    @property
    def retried(self) -> int:
        return self.inner.retried

    async def _on_server(self, coro: Any) -> Any:
        if self.stopped.is_set():
            coro.close()
            raise BatchStopped("the batch was stopped: no new task is dispatched")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        with self._lock:
            self._inflight.add(fut)
        try:
            return await asyncio.wrap_future(fut)
        except concurrent.futures.CancelledError:
            if self.stopped.is_set():
                raise BatchStopped("the batch was stopped while this task ran") from None
            raise
        finally:
            with self._lock:
                self._inflight.discard(fut)

    async def run_task(self, spec: TaskSpec) -> TaskResult:
        return await self._on_server(self.inner.run_task(spec))

    async def stats(self) -> dict[str, Any]:
        return await self._on_server(self.inner.stats())

    def stop(self) -> None:
        """No new task; the tasks in flight are cancelled (abandoned, as the embedded path does)."""
        self.stopped.set()
        with self._lock:
            for fut in list(self._inflight):
                fut.cancel()


def pipeline_keys(model: str) -> PipelineKeys:
    """``api/<model>/...``: each configured model is one pipeline of the instance."""
    from batch_inference.defs.keys import PipelineKeys
    from batch_inference.defs.steps import HostedPool

    return PipelineKeys(("api", re.sub(r"\W", "_", model) or "model"))


class DagsterBatches:
    """The Dagster side of the server: one instance, one pipeline's definitions per model."""

    def __init__(self, home: str) -> None:
        self.home = home
        self._lock = threading.Lock()
        self._instance: dg.DagsterInstance | None = None
        self._defs: dict[str, dg.Definitions] = {}
        self._pools: dict[str, HostedPool] = {}  # each model's pool resource: the bridges of its batches

    def instance(self) -> dg.DagsterInstance:
        with self._lock:
            if self._instance is None:
                import os

                import dagster as dg

                os.makedirs(self.home, exist_ok=True)
                self._instance = dg.DagsterInstance.from_config(self.home)
            return self._instance

    def definitions(self, model: str, spec_data: dict[str, Any]) -> dg.Definitions:
        """The pipeline of ``model``: its spec, whose ``run`` and ``input`` each batch's start sets."""
        with self._lock:
            if model not in self._defs:
                import dagster as dg

                from batch_inference.defs.pipeline import build_pipeline_definitions, shared_resources
                from batch_inference.defs.pool.definitions import pool_from_env
                from batch_inference.defs.runs.start import SpecSource
                from batch_inference.defs.steps import HostedPool

                self._pools[model] = HostedPool(pool_from_env())
                self._defs[model] = dg.Definitions.merge(
                    build_pipeline_definitions(pipeline_keys(model), SpecSource(inline=spec_data), automation_sensor=False),
                    shared_resources(pool=self._pools[model]))
            return self._defs[model]

    def run(self, batch_id: str, model: str, spec_data: dict[str, Any], input_url: str, bridge: ThreadBridge) -> bool:
        """Run (or resume) batch ``batch_id`` as Dagster runs of its model's pipeline (blocking).

        True when ``results[<batch id>]`` is materialised; False when the runs could not take
        the batch there (a stop, or a step whose Dagster run a killed server left unfinished:
        the sensor never relaunches a run key), and the caller finishes it in process.
        """
        import dagster as dg

        from batch_inference.defs.driver import drive, first_error
        from batch_inference.defs.runs.jobs import start_run_config
        from batch_inference.defs.runs.start import already_started
        k = pipeline_keys(model)
        defs, instance = self.definitions(model, spec_data), self.instance()
        with self._pools[model].hosting(batch_id, bridge):
            if not already_started(instance, k, batch_id):
                # no plan at the start: a batch's first shard waits for nothing; the server estimates
                # each batch's finish from its pool's measured rate (api/admission.py) instead
                config = start_run_config(None, run=batch_id, input=input_url, output=spec_data["output"], plan=False, k=k)
                result = defs.resolve_job_def(k.name("start_pipeline_run")).execute_in_process(
                    run_config=config, instance=instance, raise_on_error=False, tags={"batch_inference/batch": batch_id})
                if not result.success:
                    raise RuntimeError(f"the start of batch {batch_id} failed in Dagster: {first_error(result)}")

            def mine(request: dg.RunRequest) -> bool:
                key = request.partition_key or ""
                return not bridge.stopped.is_set() and (key == batch_id or key.startswith(f"{batch_id}|"))

            drive(defs, instance, sensor_name=k.name("round_sensor"), only=mine, max_ticks=1000)
        done = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=k.results, asset_partitions=[batch_id]), limit=1)
        return bool(done.records)
