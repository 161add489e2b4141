"""Re-running a spec on a pool left up (the workflow persistent pools exist for: keep the
model hot, change the spec, run again). Each run instance has task ids of its own, a
worker replays a finished task only while its outputs exist, and a spec that changes
under a running instance stops the run with a ``TaskConflict``, never a quarantine."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from batch_inference.pipeline import PipelineRun, PipelineSpec, RunLayout, run_pipeline
from batch_inference.pipeline.spec import SpecChanged
from batch_inference.pool import TaskConflict
from batch_inference.storage import JsonlDir
from batch_inference_tests.pipeline.helpers import CountingRunner, spec_dict

ENGINE = {"kind": "simulated", "simulated": {"approval_rate": 1.0, "latency_a_s": 0.002, "latency_b_s": 1e-5}}

pytestmark = pytest.mark.slow


def _spec(tmp_path: Path, template: str = "Answer: {prompt}", **overrides: Any) -> PipelineSpec:
    return PipelineSpec.parse(spec_dict(
        tmp_path, records=400, shard_records=100, engine=ENGINE, max_rounds=2, max_attempts=2,
        infer={"template": template, "sampling": {"max_tokens": 8, "seed": 7}},
        judge={"kind": "rule", "callable": "regex", "kwargs": {"pattern": "^APPROVED"}}, **overrides,
    ))


def _results(spec: PipelineSpec) -> dict[str, str]:
    return {row["id"]: row["result"] for row in JsonlDir(RunLayout(spec.output, spec.run).results).iter_records_sync()}


async def test_rerun_after_deleting_the_output_and_after_editing_the_template(local_pool, tmp_path: Path) -> None:
    launcher = await asyncio.to_thread(local_pool, engine_config=ENGINE, replicas=1, concurrency=4,
                                       batcher={"batch_timeout_s": 0.002})
    pids = [w.pid for w in launcher.status()]
    spec = _spec(tmp_path)
    out = Path(spec.output)
    client = await asyncio.to_thread(launcher.client, retries=1, backoff_s=0.05)
    async with client:
        first = await run_pipeline(spec, runner=client, retries=0)
        assert first.status == "converged" and first.approved == 400
        before = _results(spec)

        # 1. the same spec, its output deleted: the workers must not answer from memory
        shutil.rmtree(out)
        second = await run_pipeline(spec, runner=client, retries=0)
        assert second.status == "converged" and second.approved == 400 and second.conservation["ok"]
        assert _results(spec) == before

        # 2. the template edited, the output deleted: a new run instance, never a 409 quarantine
        shutil.rmtree(out)
        edited = _spec(tmp_path, template="Reply briefly: {prompt}")
        third = await run_pipeline(edited, runner=client, retries=0)
        assert third.status == "converged" and third.quarantined == 0 and third.approved == 400
        after = _results(edited)
        assert after.keys() == before.keys() and sum(after[i] != before[i] for i in after) > 300  # the new prompts' answers
    assert [w.pid for w in launcher.status() if w.healthy] == pids  # one pool, left up, served all three


async def test_a_spec_changed_under_a_running_instance_is_an_error_not_a_quarantine(local_pool, tmp_path: Path) -> None:
    launcher = await asyncio.to_thread(local_pool, engine_config=ENGINE, replicas=1, concurrency=4,
                                       batcher={"batch_timeout_s": 0.002})
    spec = _spec(tmp_path)
    layout = RunLayout(spec.output, spec.run)
    client = await asyncio.to_thread(launcher.client, retries=1, backoff_s=0.05)
    async with client:
        run = PipelineRun(spec, client)
        await run.shard()
        await run.infer(0)
        # The driver stopped after the tasks finished but before their progress was recorded
        # (e.g. killed): the instance resumes, and its tasks are the same tasks.
        shutil.rmtree(layout.progress_dir(layout.step_name(0, "infer")))
        Path(layout.ledger_file(layout.step_name(0, "infer"))).unlink()
        edited = _spec(tmp_path, template="Reply briefly: {prompt}")
        with pytest.raises(SpecChanged, match=r"infer\.template changed"):  # the driver compares the recorded spec
            await PipelineRun(edited, client).infer(0)
        recorded = Path(layout.ledger_file(RunLayout.SPEC))
        saved = recorded.read_bytes()
        recorded.unlink()  # with no recorded spec to compare, the workers refuse the edited tasks themselves
        with pytest.raises(TaskConflict, match="spec changed"):
            await PipelineRun(edited, client).infer(0)
        recorded.write_bytes(saved)
        assert not Path(layout.failed(0)).exists()  # nothing quarantined, no record failed
        assert not Path(layout.ledger_file(layout.step_name(0, "infer"))).exists()

        # with the spec it started with, the instance resumes: the workers replay their answers
        counting = CountingRunner(client)
        resumed = await run_pipeline(spec, runner=counting, retries=0)
        assert resumed.status == "converged" and resumed.approved == 400
        infer = PipelineRun(spec).ledger.read(layout.step_name(0, "infer"))
        assert infer is not None and infer["cached_tasks"] == 4
