"""Dagster concurrency pools on the GPU steps: two pipelines, a pool of limit 1, one GPU step at a time.

Two pipelines (two ``PipelineKeys``, as two component instances) each run round 0 at the
same moment, in two threads, against one instance whose ``concurrency.pools.default_limit``
is 1 (as dagster.yaml sets it for ``batch_inference_gpu``). Every GPU step (``inferred``,
``judge``) claims the pool's slot; the intervals between their STEP_START and the end of the
step, read back from the event log, must never overlap, and a step of one pipeline must have
waited for the other's. The control: the same with no limit overlaps.
"""

from __future__ import annotations

import logging
import multiprocessing
import tempfile
from pathlib import Path

import dagster as dg
import pytest

from batch_inference.defs.keys import GPU_POOL, PipelineKeys
from batch_inference.defs.pipeline import build_pipeline_definitions, shared_resources
from batch_inference.defs.runs.start import SpecSource, ensure_gpu_pool
from batch_inference_tests.defs.helpers import simulated_spec, write_input

GPU_STEPS = ("inferred", "judge")


def _defs(tmp_path: Path) -> tuple[dg.Definitions, list[PipelineKeys]]:
    data = tmp_path / "in.jsonl"
    write_input(data, 60)
    spec = simulated_spec("x", data, tmp_path / "out", approval=0.5, shard_records=30, chunk_size=10,
                          pool={"launcher": "inprocess", "concurrency": 2})
    spec["engine"]["simulated"]["latency_a_s"] = 0.15  # each GPU step takes ~1 s
    del spec["run"]
    pipelines = [PipelineKeys(("scoring",)), PipelineKeys(("ranking",))]
    defs = dg.Definitions.merge(*(build_pipeline_definitions(k, SpecSource(inline=spec)) for k in pipelines), shared_resources())
    return defs, pipelines


def _gpu_intervals(instance: dg.DagsterInstance, run_ids: list[str]) -> list[tuple[float, float, str]]:
    out = []
    for run_id in run_ids:
        starts: dict[str, float] = {}
        for entry in instance.all_logs(run_id):
            event = entry.dagster_event
            if event is None or not event.step_key or not any(event.step_key.endswith(s) for s in GPU_STEPS):
                continue
            if event.event_type == dg.DagsterEventType.STEP_START:
                starts[event.step_key] = entry.timestamp
            elif event.event_type in (dg.DagsterEventType.STEP_SUCCESS, dg.DagsterEventType.STEP_FAILURE):
                out.append((starts[event.step_key], entry.timestamp, event.step_key))
    return sorted(out)


POOL_OF_ONE = {"concurrency": {"pools": {"granularity": "op", "default_limit": 1}}}


def _start(defs: dg.Definitions, instance: dg.DagsterInstance, k: PipelineKeys, run: str) -> None:
    start = defs.resolve_job_def(k.name("start_pipeline_run")).execute_in_process(
        instance=instance, run_config={"ops": {k.name("start_run"): {"config": {"run": run}}}})
    assert start.success


def _round_zero(defs: dg.Definitions, ref: dg.InstanceRef, k: PipelineKeys, out: multiprocessing.Queue) -> None:
    """Round 0 of pipeline ``k`` in this (forked) process, on the shared instance."""
    with dg.DagsterInstance.from_ref(ref) as instance:
        result = defs.resolve_job_def(k.name("round_job")).execute_in_process(instance=instance, partition_key=f"{k.prefix[0]}-1|r00")
        out.put((result.success, result.run_id))


def _round_zero_of_both(tmp_path: Path, limit: int | None) -> list[tuple[float, float, str]]:
    defs, pipelines = _defs(tmp_path)
    overrides = {"concurrency": {"pools": {"granularity": "op", "default_limit": limit}}} if limit else {}
    with tempfile.TemporaryDirectory() as home, dg.instance_for_test(temp_dir=home, overrides=overrides) as instance:
        for k in pipelines:
            run = f"{k.prefix[0]}-1"
            _start(defs, instance, k, run)
            assert defs.resolve_job_def(k.name("shard_job")).execute_in_process(instance=instance, partition_key=run).success
            instance.add_dynamic_partitions(k.round_numbers.name, ["r00"])
        ctx = multiprocessing.get_context("fork")  # two run processes, as the daemon launches them
        queue = ctx.Queue()
        procs = [ctx.Process(target=_round_zero, args=(defs, instance.get_ref(), k, queue)) for k in pipelines]  # fork: nothing pickled
        for p in procs:
            p.start()
        outcomes = [queue.get(timeout=240) for _ in procs]
        for p in procs:
            p.join(timeout=30)
        assert all(ok for ok, _ in outcomes), outcomes
        return _gpu_intervals(instance, [run_id for _, run_id in outcomes])


def test_gpu_steps_are_in_the_pool(tmp_path: Path) -> None:
    defs, pipelines = _defs(tmp_path)
    for k in pipelines:
        for key in (k.inferred, k.approved, k.tail_retry):
            assert defs.resolve_assets_def(key).op.pool == GPU_POOL
        for key in (k.source, k.sharded, k.pending, k.results):
            assert defs.resolve_assets_def(key).op.pool is None


@pytest.mark.slow
@pytest.mark.process
def test_two_pipelines_on_a_pool_of_one_never_run_two_gpu_steps_at_once(tmp_path: Path) -> None:
    intervals = _round_zero_of_both(tmp_path / "limited", limit=1)
    assert len(intervals) == 4, intervals  # inferred and judge of each pipeline
    for (s1, e1, k1), (s2, e2, k2) in zip(intervals, intervals[1:]):
        assert s2 >= e1 - 0.05, f"{k2} started at {s2:.2f} before {k1} ended at {e1:.2f}: two GPU steps at once"
    prefixes = [k.split("__")[0] for _, _, k in intervals]
    assert len(set(prefixes)) == 2

    control = _round_zero_of_both(tmp_path / "unlimited", limit=None)
    assert any(s2 < e1 for (_, e1, _), (s2, _, _) in zip(control, control[1:])), f"no overlap without the pool: {control}"


def _slots(instance: dg.DagsterInstance) -> tuple[int, int | None]:
    info = instance.event_log_storage.get_concurrency_info(GPU_POOL)
    return info.slot_count, info.limit


@pytest.mark.process  # execute_in_process tails its compute logs
def test_starting_a_run_gives_the_gpu_pool_its_slots_and_keeps_a_limit_someone_set(tmp_path: Path) -> None:
    """Dagster adds a pool's default slots at the first claim, and two first claims at once add
    them twice (a pool of 1 ran two GPU steps at once in CI): a run's start makes the pool first."""
    defs, (first, second) = _defs(tmp_path)
    with tempfile.TemporaryDirectory() as home, dg.instance_for_test(temp_dir=home, overrides=POOL_OF_ONE) as instance:
        assert GPU_POOL not in {p.name for p in instance.event_log_storage.get_pool_limits()}
        _start(defs, instance, first, "scoring-1")
        assert _slots(instance) == (1, 1)
        instance.event_log_storage.set_concurrency_slots(GPU_POOL, 3)  # `dagster instance concurrency set`
        _start(defs, instance, second, "ranking-1")
        assert _slots(instance) == (3, 3)


def test_a_default_pool_that_two_first_claims_doubled_is_cut_back_to_its_limit() -> None:
    from dagster._core.storage.event_log.schema import ConcurrencySlotsTable

    with tempfile.TemporaryDirectory() as home, dg.instance_for_test(temp_dir=home, overrides=POOL_OF_ONE) as instance:
        storage = instance.event_log_storage
        storage.initialize_concurrency_limit_to_default(GPU_POOL)
        with storage.index_transaction() as conn:  # the second claimant's slot: what the race leaves
            conn.execute(ConcurrencySlotsTable.insert().values(concurrency_key=GPU_POOL))
        assert _slots(instance) == (2, 1)
        ensure_gpu_pool(instance, logging.getLogger(__name__))
        assert _slots(instance) == (1, 1)
