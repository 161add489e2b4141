"""``InProcessPool``: the worker's task code in this process, with no HTTP.

It implements the TaskRunner protocol (``limit``, ``run_task``) over one
``WorkerRuntime``: one engine, one shared batcher, ``concurrency`` slots. The
pipeline's and Dagster's fast tests and small local runs use it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from batch_inference.engines import EngineConfig, EngineDeadError
from batch_inference.pool.engine_host import BatcherOptions, EngineHost
from batch_inference.pool.protocol import TaskConflict, TaskFailed, TaskResult, TaskRunner, TaskSpec
from batch_inference.pool.failures import is_machine_error
from batch_inference.pool.runtime import EngineDead, Refused, SpecConflict, WorkerRuntime
from batch_inference.pool.context import TaskInputError

log = logging.getLogger(__name__)


class InProcessPool:
    """``async with InProcessPool(cfg, concurrency=4) as pool: await pool.run_task(spec)``.

    ``retries`` re-runs a failed task that many times (input errors are not retried),
    waiting ``backoff_s`` (doubling) between tries so that a storage blip of a few
    seconds is ridden out, as PoolClient does; then ``TaskFailed`` is raised for the
    caller to quarantine. A task that finds every slot taken waits for one (there is no
    other worker to go to): a judge pool smaller than the retry tasks that send it their
    waves is waited for, never failed. ``judge_runner`` is the judge's own pool, where
    retry tasks with a ``judge_pool`` output send their judge waves.
    """

    def __init__(
        self,
        engine_config: EngineConfig | dict[str, Any],
        *,
        concurrency: int = 10,
        batcher: BatcherOptions | dict[str, Any] | None = None,
        retries: int = 0,
        storage_profiles: dict[str, dict[str, Any]] | None = None,
        checkpoint_interval_s: float = 5.0,
        backoff_s: float = 0.5,
        judge_runner: TaskRunner | None = None,
    ) -> None:
        options = batcher if isinstance(batcher, BatcherOptions) or batcher is None else BatcherOptions.model_validate(batcher)
        self.host = EngineHost(engine_config, options)
        self.runtime = WorkerRuntime(
            self.host, concurrency=concurrency, name="inprocess",
            storage_profiles=storage_profiles, checkpoint_interval_s=checkpoint_interval_s, judge_runner=judge_runner,
        )
        self.retries = retries
        self.backoff_s = backoff_s
        self.retried = 0  # tasks re-run after a failure: the ledger's task_retries, as PoolClient counts them

    @property
    def limit(self) -> int:
        return self.runtime.concurrency

    async def __aenter__(self) -> InProcessPool:
        await self.host.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        # A caller that went away (Ctrl-C cancels the run, not the shielded tasks) leaves
        # its task running: abandon it (nothing is committed) before the batcher stops,
        # or it fails submitting to a stopped batcher and logs a traceback.
        try:
            await self.runtime.drain(grace_s=0)
        finally:
            await self.host.close()

    async def run_task(self, spec: TaskSpec) -> TaskResult:
        errors: list[str] = []
        for attempt in range(self.retries + 1):
            try:
                return await self.runtime.run(spec, wait=True)  # no other worker here: a busy one is waited for
            except (EngineDeadError, EngineDead) as exc:
                # The engine is gone and there is no other worker here: never the shard's
                # fault (no quarantine, no failed records). The run stops with this error;
                # run it again to resume.
                raise EngineDeadError(f"task {spec.task_id}: {exc}") from exc
            except SpecConflict as exc:  # the user's to resolve: never a quarantine
                raise TaskConflict(spec, str(exc)) from exc
            except TaskConflict:  # the judge pool's, for one of this task's waves: the same
                raise
            except (Refused, TaskInputError, ValueError) as exc:
                # bad input or config, a conflicting spec, or a refusal: there is no other
                # worker here to try, and the same call would fail the same way
                raise TaskFailed(spec, [*errors, f"{type(exc).__name__}: {exc}"]) from exc
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                log.warning("task %s attempt %d failed: %s", spec.task_id, attempt + 1, exc)
                if attempt < self.retries:
                    self.retried += 1
                    await asyncio.sleep(self.backoff_s * 2**attempt)
                elif is_machine_error(exc):
                    # The machine's fault, not the shard's: never quarantined. The run stops
                    # with this error; once space is freed a re-run resumes.
                    raise OSError(exc.errno, f"{exc.strerror} (task {spec.task_id} writing "
                                             f"{', '.join(sorted(spec.outputs.values()))})") from exc
        raise TaskFailed(spec, errors)

    async def stats(self) -> dict[str, Any]:
        """The one worker's ``/stats`` (as ``PoolClient.stats`` gives each worker's), no HTTP."""
        return {**self.runtime.stats(), "retried": self.retried}
