"""One step of a run from outside an event loop: ``run_step(spec, "judge", 0)``.

Blocking: it opens a runner from ``spec.pool`` only for the steps that dispatch shard
tasks (``_NEEDS_RUNNER``), runs the one ``PipelineRun`` step on its own event loop and
returns its summary. For scripts that run a step per process; the Dagster assets go through
``defs.steps``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from batch_inference.pipeline.gate import RoundGate
from batch_inference.pipeline.run import EtaEstimate, PipelineRun
from batch_inference.pipeline.spec import PipelineSpec

__all__ = ["run_step"]

_STEPS = ("shard", "infer", "judge", "decide", "recompact", "tail", "finalize", "judged_round", "tail_from", "finish",
          "sharded_input", "pending_round", "inferred_round")
_NEEDS_RUNNER = {"infer", "judge", "tail", "judged_round", "tail_from", "inferred_round"}


def run_step(spec: PipelineSpec, step: str, *args: Any, eta: EtaEstimate | None = None, gate: RoundGate | None = None) -> Any:
    """Blocking helper: run one step (opening a runner when the step needs one).

    ``eta`` adds the run's ETA to a decision, ``gate`` is where a round waits for people (``PipelineRun``)."""

    async def go() -> Any:
        if step not in _NEEDS_RUNNER:
            fn = getattr(PipelineRun(spec, eta=eta, gate=gate), step)
            res = fn(*args)
            return await res if asyncio.iscoroutine(res) else res
        from batch_inference.pipeline.runner import open_runner

        async with open_runner(spec) as runner:
            return await getattr(PipelineRun(spec, runner, eta=eta, gate=gate), step)(*args)

    if step not in _STEPS:
        raise ValueError(f"unknown step {step!r}")
    return asyncio.run(go())
