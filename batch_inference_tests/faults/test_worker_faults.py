"""Worker faults on a real local pool: SIGKILL mid-task (Strategy 1 and 2), all workers
killed at once, SIGTERM (graceful drain). Each run ends in a full conservation check."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from batch_inference.pipeline import run_pipeline
from batch_inference_tests.fixtures.pool import kill_worker
from batch_inference_tests.faults.helpers import assert_conserved, make_spec, write_input

# ~20 ms per batch: a 50-record shard task lasts long enough to be caught mid-flight.
SLOW_ENGINE: dict[str, Any] = {"kind": "simulated", "simulated": {"approval_rate": 0.6, "latency_a_s": 0.02, "latency_b_s": 0.0}}


async def _busy_workers(launcher: Any) -> list[int]:
    """PIDs of healthy workers that are running a task right now."""
    statuses = await asyncio.to_thread(launcher.status)
    return [s.pid for s in statuses if s.healthy and s.detail.get("tasks_running", 0) > 0]


async def _killer(launcher: Any, run: asyncio.Task[Any], *, kills: int, sig: int, every_worker: bool = False,
                  pause_s: float = 0.3) -> list[tuple[list[int], float | None]]:
    """Signal busy workers (one, or all at once) ``kills`` times while ``run`` is going.

    Returns, per fault, the victims and the seconds until the pool was whole again
    (``replicas`` healthy workers; None if the run ended first).
    """
    done: list[tuple[list[int], float | None]] = []
    while len(done) < kills and not run.done():
        busy = await _busy_workers(launcher)
        if not busy:
            await asyncio.sleep(0.02)
            continue
        victims = [s.pid for s in await asyncio.to_thread(launcher.status) if s.alive] if every_worker else busy[:1]
        t0 = time.monotonic()
        for pid in victims:
            await asyncio.to_thread(kill_worker, pid, sig)
        healed: float | None = None
        while not run.done() and time.monotonic() - t0 < 30:
            statuses = await asyncio.to_thread(launcher.status)
            if sum(1 for s in statuses if s.healthy and s.pid not in victims) >= launcher.replicas:
                healed = time.monotonic() - t0
                break
            await asyncio.sleep(0.05)
        done.append((victims, healed))
        await asyncio.sleep(pause_s)
    return done


async def _run_with_faults(spec: Any, launcher: Any, **killer: Any) -> tuple[Any, list[tuple[list[int], float | None]]]:
    async with launcher.client(retries=8, backoff_s=0.1, max_backoff_s=1.0, down_cooldown_s=0.5) as client:
        run = asyncio.create_task(run_pipeline(spec, runner=client))
        kills = await _killer(launcher, run, **killer)
        summary = await asyncio.wait_for(run, 180)
        print(f"RECOVERY {spec.strategy} {killer}: pool whole again after {[h and round(h, 2) for _, h in kills]} s; "
              f"run wall {summary.wall_s:.1f}s, retried tasks {client.retried}")
        return summary, kills


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["rounds", "in_place"])
async def test_sigkill_a_busy_worker_several_times(tmp_path: Path, local_pool: Any, strategy: str) -> None:
    ids = write_input(tmp_path / "input.jsonl", 800)
    spec = make_spec(tmp_path, strategy=strategy, engine=SLOW_ENGINE, shard_records=50, chunk_size=25)
    launcher = local_pool(engine_config=SLOW_ENGINE, replicas=2, concurrency=3, grace_s=2.0)
    summary, kills = await _run_with_faults(spec, launcher, kills=3, sig=signal.SIGKILL, pause_s=0.1)
    assert len(kills) == 3, f"the run ended after {len(kills)} kill(s): make the engine slower"
    assert summary.failed == 0 and summary.status in ("converged", "exhausted")
    counts = assert_conserved(spec, ids)
    assert counts["approved"] == summary.approved > 0
    assert summary.conservation["ok"]


@pytest.mark.slow
async def test_all_workers_killed_mid_round_pool_restarts(tmp_path: Path, local_pool: Any) -> None:
    ids = write_input(tmp_path / "input.jsonl", 400)
    spec = make_spec(tmp_path, engine=SLOW_ENGINE)
    launcher = local_pool(engine_config=SLOW_ENGINE, replicas=2, concurrency=3, grace_s=2.0)
    before = {s.pid for s in launcher.status()}
    summary, kills = await _run_with_faults(spec, launcher, kills=1, sig=signal.SIGKILL, every_worker=True)
    assert len(kills) == 1 and set(kills[0][0]) == before
    after = {s.pid for s in launcher.status() if s.healthy}
    assert after and not (after & before), "the launcher restarted the pool"
    assert summary.failed == 0
    assert_conserved(spec, ids)


@pytest.mark.slow
async def test_sigterm_drains_a_worker_without_loss(tmp_path: Path, local_pool: Any) -> None:
    ids = write_input(tmp_path / "input.jsonl", 800)
    spec = make_spec(tmp_path, engine=SLOW_ENGINE)
    launcher = local_pool(engine_config=SLOW_ENGINE, replicas=2, concurrency=3, grace_s=5.0)
    summary, kills = await _run_with_faults(spec, launcher, kills=2, sig=signal.SIGTERM, pause_s=0.1)
    assert len(kills) == 2
    assert summary.failed == 0
    assert_conserved(spec, ids)
    # graceful: the drained workers finished what they had (no task abandoned)
    logs = "".join(Path(p).read_text(errors="replace") for p in Path(launcher.dir).glob("worker-*.log"))
    assert "draining" in logs and "abandoned" not in logs
