"""GPU steps reach a persistent worker pool through the pool resource; the pool outlives runs."""

from __future__ import annotations

import json
import urllib.request

import pytest

from batch_inference.definitions import build_definitions
from batch_inference.defs.driver import drive, start_run
from batch_inference.defs.pool.resources import PoolResource
from batch_inference.defs.runs.jobs import start_run_config
from batch_inference.defs.storage.resources import StorageResource

pytestmark = pytest.mark.slow


def tasks_completed(endpoint: str) -> int:
    with urllib.request.urlopen(f"{endpoint}/stats", timeout=10) as resp:
        return int(json.loads(resp.read())["tasks_completed"])


def test_rounds_run_on_the_persistent_pool(local_pool, instance, write_spec):
    launcher = local_pool(replicas=1, concurrency=4)
    (endpoint,) = launcher.endpoints()
    (worker,) = launcher.status()
    defs = build_definitions(pool=PoolResource(mode="endpoints", endpoints=[endpoint]), storage=StorageResource())

    # The spec asks for an in-process pool; the resource sends the tasks to the workers instead.
    start_run(defs, instance, start_run_config(str(write_spec("pooled", records=40, max_rounds=2))))
    result = drive(defs, instance)

    assert all(r.success for r in result.launched) and result.launched[-1].job_name == "results_job"
    rounds = sum(r.job_name == "round_job" for r in result.launched)
    shards = 2  # 40 records / 20 per shard in round 0 (later rounds repack into fewer)
    assert tasks_completed(endpoint) >= 2 * shards + 2 * (rounds - 1)  # infer + judge tasks of every round
    # Several Dagster runs came and went; the same worker process served them all and is still up.
    assert [s.pid for s in launcher.status() if s.healthy] == [worker.pid]
