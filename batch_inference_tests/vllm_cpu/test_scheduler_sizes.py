"""Real vLLM (the CPU build): the streaming engine is sized like offline ``vllm.LLM`` and
reads the engine's own occupancy through vLLM's stat-logger plug-in. ``make test-vllm``.

A module of its own: one vLLM engine per process at a time (test_streaming_vllm's
module-scoped engine is gone by the time this one starts).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from batch_inference.engines import SamplingParams  # noqa: E402
from batch_inference.pool.engine_host import EngineHost  # noqa: E402
from batch_inference.pool.request import GenRequest  # noqa: E402

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.asyncio]


def engine_config(model: Path) -> dict:
    """No scheduler sizes given: the engine picks its own."""
    return {"kind": "vllm", "model": str(model), "dtype": "float32", "max_model_len": 512,
            "vllm": {"enforce_eager": True, "extra": {"enable_chunked_prefill": False}}}


async def test_scheduler_sizes_are_offline_vllms_and_occupancy_comes_through_the_stat_logger_plugin(tiny_model_dir: Path) -> None:
    """With no sizes given, the streaming engine schedules like offline ``vllm.LLM`` (a batch
    job), not with AsyncLLM's server defaults (128 seqs, 2,048 tokens), and the engine's own
    occupancy arrives through our ``StatLoggerBase`` plug-in (one per engine core)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.metrics.loggers import PerEngineStatLoggerAdapter, StatLoggerBase

    from batch_inference.engines.config import EngineConfig
    from batch_inference.engines.vllm_engine import engine_kwargs

    cfg = engine_config(tiny_model_dir)
    offline = EngineArgs(**engine_kwargs(EngineConfig.model_validate(cfg))).create_engine_config(UsageContext.LLM_CLASS)
    async with EngineHost(cfg) as h:
        sched = h.engine._llm.vllm_config.scheduler_config  # type: ignore[union-attr]
        assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (
            offline.scheduler_config.max_num_seqs, offline.scheduler_config.max_num_batched_tokens)
        assert sched.max_num_seqs > 128 and h.gate is not None and h.gate.capacity == 2 * sched.max_num_seqs
        loggers = h.engine._llm.logger_manager.stat_loggers  # type: ignore[union-attr]
        ours = [x for lg in loggers if isinstance(lg, PerEngineStatLoggerAdapter) for x in lg.per_engine_stat_loggers.values()]
        assert [type(x).__name__ for x in ours] == ["OccupancyLogger"] and isinstance(ours[0], StatLoggerBase)
        # long enough for the sampler to see them run: 40 x 64 tokens ended within two 20 ms samples once
        futures = await h.submit([GenRequest(f"occupancy {i}", SamplingParams(max_tokens=256, min_tokens=256, temperature=1.0, seed=i), 0) for i in range(40)])
        running: list[int] = []
        while not all(f.done() for f in futures):
            running.append(h.occupancy().running)  # type: ignore[union-attr]
            await asyncio.sleep(0.02)
        assert max(running) == 40 and all(f.result().completion_tokens == 256 for f in futures)
