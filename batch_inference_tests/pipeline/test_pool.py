"""The pipeline on a real local worker pool (HTTP, separate processes), once:
a hybrid run (a round, then the in-place tail) during which a worker is SIGKILLed."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import orjson
import pytest

from batch_inference.pipeline import PipelineSpec, run_pipeline
from batch_inference.storage import CheckpointStore
from batch_inference_tests.fixtures.pool import kill_worker
from batch_inference_tests.pipeline.helpers import spec_dict

ENGINE = {"kind": "simulated", "simulated": {"approval_rate": 0.3, "latency_a_s": 0.03, "latency_b_s": 0.0}}


@pytest.mark.slow
async def test_hybrid_on_real_workers_survives_a_sigkill_mid_tail(local_pool, tmp_path: Path) -> None:
    launcher = await asyncio.to_thread(local_pool, engine_config=ENGINE, replicas=2, concurrency=2,
                                       batcher={"batch_timeout_s": 0.002})
    spec = PipelineSpec.parse(spec_dict(
        tmp_path, records=400, strategy="hybrid", max_rounds=3, max_attempts=6, shard_records=100, chunk_size=10,
        engine=ENGINE, crossover={"min_shrink": 0.5, "compare_cost": False}, pool={"launcher": "local", "concurrency": 2},
    ))
    root = Path(spec.output) / spec.run
    stores = [CheckpointStore(str(root / "tail" / "checkpoints" / f"part-{i:05d}")) for i in range(3)]
    client = await asyncio.to_thread(launcher.client, retries=3, backoff_s=0.05)
    async with client:
        run = asyncio.create_task(run_pipeline(spec, runner=client))
        deadline = time.monotonic() + 90

        def reached(attempt: int) -> bool:
            return any(s.get("attempt", 0) >= attempt for st in stores for s in st.load_sync().values())

        while not await asyncio.to_thread(reached, 2):
            assert not run.done(), "the run ended before a worker could be killed"
            assert time.monotonic() < deadline, "the tail never reached attempt 2"
            await asyncio.sleep(0.02)
        at_kill = {s.url: await asyncio.to_thread(s.load_sync) for s in stores}
        killed_at = time.time_ns()
        victim = launcher.status()[0].pid
        await asyncio.to_thread(kill_worker, victim, signal.SIGKILL)
        summary = await asyncio.wait_for(run, 120)
    assert client.retried >= 1  # the killed worker's tasks went to the other worker
    tail = orjson.loads((root / "ledger" / "tail.json").read_bytes())
    assert tail["task_retries"] >= 1  # and the ledger says so
    assert summary.rounds == 1 and summary.tail
    assert summary.conservation["ok"] and summary.approved + summary.max_attempts == 400
    # every sample checkpointed at the kill resumed at (never before) the attempt it was on
    for store in stores:
        before = at_kill[store.url]
        first_after: dict[str, dict] = {}
        for seg in store.segments():
            if int(seg.name.split("-")[1]) >= killed_at:
                for state in seg.iter_records_sync():
                    first_after.setdefault(state["id"], state)
        for rid, state in before.items():
            if "final" not in state and rid in first_after:
                assert first_after[rid]["attempt"] >= state["attempt"], rid
