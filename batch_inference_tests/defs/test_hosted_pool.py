"""A host's runner reaches the GPU steps through the ``pool`` resource it binds
(``defs.steps.HostedPool``), not through a module-level registry."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg

from batch_inference.defs.pool.resources import PoolResource
from batch_inference.defs.steps import HostedPool, run_gpu_step
from batch_inference.pipeline import PipelineSpec
from batch_inference_tests.pipeline.helpers import spec_dict


class StubRunner:
    """A runner nobody dispatches to: the test asks only which runner a step was given."""

    limit = 1
    retried = 0

    async def run_task(self, spec: Any) -> Any:
        raise AssertionError("not dispatched in this test")

    async def stats(self) -> dict[str, Any]:
        return {}


def test_a_hosted_runs_gpu_step_dispatches_through_the_runner_its_host_handed_in(tmp_path: Path) -> None:
    spec = PipelineSpec.parse(spec_dict(tmp_path))
    hosted, runner = HostedPool(PoolResource(mode="inprocess")), StubRunner()
    with hosted.hosting(spec.run, runner):
        assert run_gpu_step(spec, hosted, _runner_of) is runner
    assert hosted.runner_for(spec.run) is None  # handed back when the host's batch ends
    other = run_gpu_step(spec, hosted, _runner_of)  # not hosted: the base pool opens its own
    assert other is not runner and other is not None


async def _runner_of(run: Any) -> Any:
    return run.runner


def test_dagster_hands_a_step_the_very_pool_object_the_host_bound() -> None:
    hosted = HostedPool(PoolResource(mode="inprocess"))
    seen: list[object] = []

    @dg.asset
    def gpu_step(pool: PoolResource) -> None:
        seen.append(pool)

    assert dg.materialize([gpu_step], resources={"pool": hosted}).success
    assert seen == [hosted]
