"""The scale simulation: virtual time, the capacity math, conservation, the real decision code."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from batch_inference.engines.profiles import PROFILES
from batch_inference.pipeline import PipelineSpec
from batch_inference.planning.clock import VirtualClockLoop, run_virtual
from batch_inference.planning.cluster import Cluster, Overheads
from batch_inference.planning.rates import EngineRates, Workload, engine_rates
from batch_inference.planning.simulation import LAYOUT_PHASE, simulate

RATES = EngineRates(infer_s=0.005, judge_s=0.003, infer_latency_s=5.0, judge_latency_s=0.5, infer_tokens_out=115,
                    steps_per_record=0.12, calls_per_record=0.036, scheduling="continuous", profile="test")


def spec(strategy: str = "rounds", **kw: object) -> PipelineSpec:
    return PipelineSpec.parse({
        "run": "t", "input": "sim://in", "output": "sim://out", "engine": {"kind": "simulated"},
        "infer": {"template": "{prompt}"}, "judge": {"kind": "llm", "template": "{prompt} {result}"},
        "strategy": strategy, "max_rounds": 5, "max_attempts": 5, "shard_records": 2_000,
        "pool": {"replicas": 4, "concurrency": 5}, **kw,
    })


def test_virtual_clock_jumps_instead_of_sleeping() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        await asyncio.gather(asyncio.sleep(3600), asyncio.sleep(7200))
        return loop.time()

    import time

    t0 = time.perf_counter()
    assert run_virtual(main) == pytest.approx(7200)
    assert time.perf_counter() - t0 < 1.0


def test_a_deadlock_raises_instead_of_hanging() -> None:
    async def main() -> None:
        await asyncio.get_running_loop().create_future()

    with pytest.raises(RuntimeError, match="deadlock"):
        run_virtual(main)
    assert isinstance(VirtualClockLoop(), asyncio.AbstractEventLoop)


def test_one_pass_follows_the_capacity_math() -> None:
    w = Workload(records=400_000, approval=0.9)
    res = simulate(spec(), w, RATES, phases="one_round", overheads=Overheads(phase_launch_s=0, task_s=0, driver_task_s=0))
    assert res.waves == pytest.approx(400_000 / 2_000 / 20)  # 200 shards over 4 x 5 slots
    # the engine work is exact: every record inferred and judged once, on 4 replicas
    assert res.engine_s == pytest.approx(400_000 * (RATES.infer_s + RATES.judge_s), rel=1e-6)
    infer = next(r for r in res.rounds if r.name == "round 0 infer")
    assert infer.wall_s >= 400_000 * RATES.infer_s / 4  # no faster than 4 engines at full rate
    assert res.approved + res.unfinished == 400_000
    assert res.model_calls == pytest.approx(400_000 * RATES.calls_per_record)


def test_finalize_checks_conservation_over_every_record_with_the_pool_held() -> None:
    """``Overheads.finalize_records_per_s``: the run's conservation check, one pass over every
    record on the driver (bench/reports/scale_10m.md), after the last phase, every GPU still held."""
    w = Workload(records=400_000, approval=0.9)
    base = Overheads(phase_launch_s=0, task_s=0, driver_task_s=0, list_page_s=0, progress_read_s=0)
    plain = simulate(spec(), w, RATES, phases="one_round", overheads=dataclasses.replace(base, finalize_records_per_s=0))
    checked = simulate(spec(), w, RATES, phases="one_round", overheads=dataclasses.replace(base, finalize_records_per_s=20_000))
    assert checked.wall_s - plain.wall_s == pytest.approx(400_000 / 20_000)
    assert checked.gpu_s - plain.gpu_s == pytest.approx(4 * 400_000 / 20_000)  # 4 replicas held through it
    assert next(r for r in checked.rounds if r.name == "results + finalize").wall_s == pytest.approx(20)

def test_the_judge_step_reads_the_infer_phases_progress_records_first() -> None:
    """``Overheads.progress_read_s`` per shard before each judge phase (the driver's ledger read,
    bench/reports/ledger_overhead.md), none before an infer phase."""
    w = Workload(records=400_000, approval=0.9)
    base = Overheads(phase_launch_s=0, task_s=0, driver_task_s=0, list_page_s=0, progress_read_s=0)
    plain = simulate(spec(), w, RATES, phases="one_round", overheads=base)
    read = simulate(spec(), w, RATES, phases="one_round", overheads=dataclasses.replace(base, progress_read_s=0.5))
    assert read.wall_s - plain.wall_s == pytest.approx(200 * 0.5)  # 200 shards, once (the judge phase)
    assert Overheads().progress_read_s > 0 and Overheads().driver_task_s > 0


@pytest.mark.parametrize("strategy", ["rounds", "in_place", "hybrid"])
def test_every_record_ends_in_one_terminal_state(strategy: str) -> None:
    w = Workload(records=200_000, approval=0.5)
    res = simulate(spec(strategy), w, RATES)
    assert res.approved + res.unfinished + res.quarantined == 200_000
    assert 0.9 < res.approved / 200_000 < 1.0  # 1 - 0.5^5 ~ 0.97
    if strategy != "in_place":
        assert res.decisions and res.decisions[0].round == 0
        assert res.decisions[-1].kind in ("exhausted", "tail", "done")


def test_hybrid_decisions_are_the_pipelines_rule() -> None:
    """Huge per-round overheads make rounds pay badly: the real rule hands over after round 0;
    with none, and in-place attempts costlier than a round's, it keeps to rounds."""
    w = Workload(records=200_000, approval=0.5)
    slow = Overheads(phase_launch_s=3_000, round_gap_s=3_000)
    res = simulate(spec("hybrid"), w, RATES, overheads=slow)
    assert res.decisions[0].kind == "tail" and "projected rounds" in res.decisions[0].reason
    costly = spec("hybrid", crossover={"in_place_cost_factor": 2.0})
    fast = simulate(costly, w, RATES, overheads=Overheads(phase_launch_s=0, round_gap_s=0, task_s=0, object_s=0))
    assert fast.decisions[0].kind == "next_round"


def test_preemption_redoes_whole_shards_in_rounds_and_little_in_place() -> None:
    w = Workload(records=400_000, approval=0.5)
    chaos = Cluster(replicas=4, concurrency=5, preemptions_per_gpu_hour=20.0, seed=5)
    rounds = simulate(spec("rounds", shard_records=20_000), w, RATES, cluster=chaos)
    in_place = simulate(spec("in_place", shard_records=20_000), w, RATES, cluster=chaos)
    assert rounds.preemptions > 0 and in_place.preemptions > 0 and rounds.retries > 0
    assert rounds.redone_s > 5 * in_place.redone_s
    for res in (rounds, in_place):
        assert res.approved + res.unfinished + res.quarantined == 400_000


def test_engine_rates_come_from_the_decode_model() -> None:
    w = Workload(records=1, prompt_tokens=200, output_tokens=100)
    cont = engine_rates(PROFILES["h200-llama-8b"], w, sample=2_000)
    old = engine_rates(PROFILES["h200-llama-8b"], w, sample=2_000, scheduling="blocking")
    assert old.infer_s > 3 * cont.infer_s  # 12,800-token barrier batches vs a full continuous engine
    assert cont.judge_s < cont.infer_s  # a judge decodes a few tokens
    assert dataclasses.replace(cont, infer_s=1.0).per_attempt_s == 1.0 + cont.judge_s


def test_the_engine_rates_of_a_prefix_heavy_workload_follow_its_cache_and_order() -> None:
    """Documents x questions through the decode model's prefix cache: the layout's order gets
    close to the ideal hit rate; input order at scale gets nothing; no cache, every token."""
    from batch_inference.engines.profiles import get_profile
    from batch_inference.planning.rates import Workload, engine_rates

    profile = get_profile("h200-llama-8b")
    w = Workload(records=100_000_000, prompt_tokens=1_540, prefix_share=1_500 / 1_540, prefix_family=8, judge_prefix=True)
    none = engine_rates(profile, w, sample=2_000, prefix_cache=False)
    grouped = engine_rates(profile, w, sample=2_000)
    scattered = engine_rates(profile, dataclasses.replace(w, prefix_layout="interleaved"), sample=2_000)
    ideal = w.prefix_share * (1 - 1 / w.prefix_family)
    assert none.prefix_hit_rate == 0 and ideal - 0.02 < grouped.prefix_hit_rate <= ideal
    assert scattered.prefix_hit_rate < 0.02 and grouped.judge_prefix_hit_rate > 0.5
    assert grouped.infer_s < 0.7 * none.infer_s and grouped.judge_s < 0.5 * none.judge_s
    assert abs(scattered.infer_s / none.infer_s - 1) < 0.03


def test_the_layout_pass_holds_every_gpu_idle_for_its_wall() -> None:
    """The pool is open before the shard step: the layout pass's wall (its parallel part over
    ``layout_workers``, plus its serial part) is GPU time paid and idle, on every replica."""
    w = Workload(records=400_000, approval=0.9)
    base = Overheads(phase_launch_s=0, task_s=0, driver_task_s=0, list_page_s=0, progress_read_s=0)
    plain = simulate(spec(), w, RATES, phases="one_round", overheads=base)
    costs = dataclasses.replace(base, layout_record_s=500e-6, layout_serial_record_s=20e-6)
    # round 0 after the whole pass (Dagster's steps; layout.stream off)
    serial = simulate(spec(), w, RATES, phases="one_round", overheads=costs, stream_round0=False)
    spread = simulate(spec(), w, RATES, phases="one_round", overheads=dataclasses.replace(costs, layout_workers=10),
                      stream_round0=False)
    off = simulate(spec(layout={"prefix": False}), w, RATES, phases="one_round", overheads=costs)
    for res, wall in ((serial, 400_000 * 520e-6), (spread, 400_000 * 70e-6)):
        lay = next(r for r in res.rounds if r.name == LAYOUT_PHASE)
        assert lay.wall_s == pytest.approx(wall) and lay.engine_s == 0
        assert res.wall_s - plain.wall_s == pytest.approx(wall)
        assert res.gpu_s - plain.gpu_s == pytest.approx(4 * wall)  # 4 replicas held through it
        assert res.engine_s == pytest.approx(plain.engine_s)
    assert off.wall_s == pytest.approx(plain.wall_s) and not any("layout" in r.name for r in off.rounds)


@pytest.mark.parametrize("serial_record_s", [20e-6, 2e-3])
def test_round_0_beside_the_rewrite_holds_the_gpus_idle_through_the_spread_part_alone(serial_record_s: float) -> None:
    """Round 0 starts on the rewritten shards as they come (pipeline.stream): the GPUs wait
    through the signing only; the merge and rewrite overlap round 0, which cannot end before
    the last shard is written. A rewrite faster than the GPUs (20 us a record) or slower (2 ms)."""
    w = Workload(records=400_000, approval=0.9)
    base = Overheads(phase_launch_s=0, task_s=0, driver_task_s=0, list_page_s=0, progress_read_s=0)
    costs = dataclasses.replace(base, layout_record_s=500e-6, layout_serial_record_s=serial_record_s, layout_workers=10)
    plain = simulate(spec(), w, RATES, phases="one_round", overheads=base)
    whole = simulate(spec(), w, RATES, phases="one_round", overheads=costs, stream_round0=False)
    streamed = simulate(spec(), w, RATES, phases="one_round", overheads=costs)
    spread_s, rewrite_s = 400_000 * 50e-6, 400_000 * serial_record_s
    lay = next(r for r in streamed.rounds if r.name == LAYOUT_PHASE)
    assert lay.wall_s == pytest.approx(spread_s + rewrite_s) and lay.overhead_s == pytest.approx(spread_s)
    saved = whole.wall_s - streamed.wall_s
    assert 0 < saved <= rewrite_s + 1e-6
    assert streamed.wall_s >= max(plain.wall_s + spread_s, spread_s + rewrite_s) - 1e-6
    assert streamed.engine_s == pytest.approx(whole.engine_s)
    in_place = simulate(spec(strategy="in_place"), w, RATES, phases="one_round", overheads=costs)
    assert next(r for r in in_place.rounds if r.name == LAYOUT_PHASE).overhead_s == pytest.approx(spread_s + rewrite_s)
