"""A batch as a pipeline run: its spec, its model's shared pool, and where its steps run.

``BatchRuns`` builds a batch's ``PipelineSpec`` from its model's config (engine, pool, judge,
limits) over its ``input.jsonl`` plus its endpoint's spec keys, opens each model's pool once
(``FairShare``: every batch of the model shares it) and runs a batch's pipeline, in process
(``run_pipeline``) or, with ``dagster:``, as the pipeline's Dagster runs (``api.dagster_runs``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from batch_inference.api.admission import admission_keys
from batch_inference.api.config import ApiConfig
from batch_inference.api.endpoints import ENDPOINTS
from batch_inference.api.fair import FairShare, OnResult
from batch_inference.api.protocol import BatchRecord
from batch_inference.api.store import Store
from batch_inference.pipeline.spec import PipelineSpec, SpecError
from batch_inference.prompting.embeddings import infer_keys

if TYPE_CHECKING:
    from batch_inference.api.dagster_runs import DagsterBatches

log = logging.getLogger(__name__)

NO_JUDGE = {"kind": "none"}  # every answer accepted, as hosted APIs do: one inference per request


def probe(name: str, batch_id: str) -> BatchRecord:
    """A record that runs ``name`` (to build a model's spec outside any batch)."""
    return BatchRecord(id=batch_id, endpoint="/v1/chat/completions", source_url="", completion_window="24h", created_at=0, run=name)


class BatchRuns:
    """The pipeline side of the server's batches: specs, the models' pools, running a batch."""

    def __init__(self, config: ApiConfig, store: Store, *, on_result: OnResult | None = None) -> None:
        self.config, self.store = config, store
        self._on_result = on_result  # each task's result, for the usage book (api/usage.py)
        self._shares: dict[str, FairShare] = {}
        self._open_lock = asyncio.Lock()
        self._exit = contextlib.AsyncExitStack()
        self.dagster: DagsterBatches | None = None
        if config.dagster is not None:
            from batch_inference.api.dagster_runs import DagsterBatches

            self.dagster = DagsterBatches(config.dagster.home)

    def spec_for(self, record: BatchRecord) -> PipelineSpec:
        """The pipeline spec of a batch: its model's engine, pool and judge over its ``input.jsonl``."""
        return PipelineSpec.parse(self.spec_data(record), source=f"model {record.run_model!r} of the API config")

    def spec_data(self, record: BatchRecord) -> dict[str, Any]:
        """``spec_for``'s keys, before parsing (the Dagster start job parses them with the batch's run and input)."""
        name = record.run_model
        assert name is not None, f"batch {record.id} runs nothing"
        m = self.config.models[name]
        pool = m.pool if "name" in m.pool.model_fields_set else m.pool.model_copy(update={"name": f"api-{name}"})
        return {
            "run": record.id, "input": f"{self.store.batch_dir(record.id)}/input.jsonl", "input_format": "openai_batch",
            "openai_batch": {"model": name}, "output": self.store.runs, "engine": m.engine,
            "infer": {"sampling": m.sampling.model_dump(), "limits": m.limits.model_dump(), **infer_keys(m.engine)},
            "judge": m.judge if m.judge is not None else NO_JUDGE,
            "strategy": m.strategy if m.judge is not None else "in_place",
            "max_rounds": m.max_rounds, "max_attempts": m.max_attempts if m.judge is not None else 1,
            "shard_records": m.shard_records, "chunk_size": m.chunk_size, "pool": pool,
            "storage_options": self.config.storage_options,
            **ENDPOINTS[record.endpoint].spec,
        }

    def check_models(self) -> None:
        """Every model's spec builds (engine folder, judge, pool): a config error stops the server at start."""
        from batch_inference.api.config import ApiConfigError

        for name in self.config.models:
            try:
                self.spec_for(probe(name, "batch_check"))
            except SpecError as exc:
                raise ApiConfigError(str(exc)) from None

    async def share(self, name: str) -> FairShare:
        """The model's pool (opened at its first batch, kept for the next), shared fairly."""
        async with self._open_lock:
            if name not in self._shares:
                from batch_inference.pipeline.runner import open_runner

                template = self.spec_for(probe(name, "batch_pool"))
                runner = await self._exit.enter_async_context(open_runner(template))
                self._shares[name] = FairShare(runner, slack_s=self.config.limits.deadline_slack, on_result=self._on_result)
            return self._shares[name]

    @property
    def open_shares(self) -> dict[str, FairShare]:
        """The pools opened so far, by model."""
        return dict(self._shares)

    async def run(self, record: BatchRecord) -> None:
        """Run the batch's pipeline to its end (resuming from its ledger)."""
        from batch_inference.pipeline.driver import run_pipeline
        from batch_inference.review.lifecycle import ReviewGate

        assert record.run_model is not None
        spec = await asyncio.to_thread(self.spec_for, record)
        share = await self.share(record.run_model)
        if self.dagster is not None and await self._run_in_dagster(record, spec, share):
            return
        await run_pipeline(spec, runner=share.for_batch(record.id, **admission_keys(record.to_json())), gate=ReviewGate())

    async def _run_in_dagster(self, record: BatchRecord, spec: PipelineSpec, share: FairShare) -> bool:
        """The batch's steps as Dagster runs of its model's pipeline (``api.dagster_runs``), in a
        thread; a cancel of this task stops the batch's tasks and waits for the thread to end, so
        nothing writes to the run after the stop delivers it. False: finish in process."""
        from batch_inference.api.dagster_runs import ThreadBridge

        assert self.dagster is not None
        bridge = ThreadBridge(share.for_batch(record.id, **admission_keys(record.to_json())), asyncio.get_running_loop())
        data = self.spec_data(record)
        work = asyncio.ensure_future(asyncio.to_thread(self.dagster.run, record.id, record.run_model, data, spec.input, bridge))
        try:
            done = await asyncio.shield(work)
        except asyncio.CancelledError:
            bridge.stop()
            await asyncio.gather(work, return_exceptions=True)
            raise
        if not done:
            log.warning("batch %s: its Dagster runs did not reach results (a run a killed server left unfinished?): "
                        "finishing it in this process", record.id)
        return done

    async def close(self) -> None:
        """Close the models' pools."""
        await self._exit.aclose()
