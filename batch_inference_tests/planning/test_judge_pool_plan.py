"""A judge with its own model and pool, priced: the simulation runs each phase on its pool
and the tail's two parts at once, and the planner prices the pools apart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from batch_inference.pipeline import PipelineSpec
from batch_inference.planning.cluster import Cluster, Overheads
from batch_inference.planning.plan import make_plan
from batch_inference.planning.rates import EngineRates, Workload
from batch_inference.planning.simulation import simulate

INFER = EngineRates(infer_s=0.004, judge_s=0.004, infer_latency_s=0.0, judge_latency_s=0.0, infer_tokens_out=100,
                    steps_per_record=0.1, calls_per_record=0.03, scheduling="continuous", profile="test")
JUDGE = EngineRates(infer_s=0.0, judge_s=0.004, infer_latency_s=0.0, judge_latency_s=0.0, infer_tokens_out=0,
                    steps_per_record=0.1, calls_per_record=0.03, scheduling="continuous", profile="test-judge")
QUIET = Overheads(phase_launch_s=0, round_gap_s=0, task_s=0, driver_task_s=0, list_page_s=0, object_s=0, progress_read_s=0,
                  reshard_records_per_s=1e12, recompact_records_per_s=1e12)


def spec(strategy: str, *, judge_engine: bool = True, **kw: Any) -> PipelineSpec:
    judge: dict[str, Any] = {"kind": "llm", "template": "{prompt} {result}"}
    if judge_engine:
        judge.update(engine={"kind": "simulated", "seed": 1}, pool={"replicas": 2, "concurrency": 5})
    return PipelineSpec.parse({
        "run": "t", "input": "sim://in", "output": "sim://out", "engine": {"kind": "simulated"},
        "infer": {"template": "{prompt}"}, "judge": judge, "strategy": strategy, "max_rounds": 5, "max_attempts": 5,
        "shard_records": 1_000, "pool": {"replicas": 2, "concurrency": 5}, **kw,
    })


def test_the_judge_phase_runs_on_the_judge_pool_and_each_pool_is_priced() -> None:
    w = Workload(records=100_000, approval=0.5)
    cluster, judges = Cluster(replicas=2, concurrency=5), Cluster(replicas=4, concurrency=5)
    res = simulate(spec("rounds"), w, INFER, cluster=cluster, overheads=QUIET, judge_cluster=judges, judge_rates=JUDGE,
                   phases="one_round")
    infer, judge = (r for r in res.rounds if r.name.startswith("round 0"))
    # the same per-record cost on twice the replicas: the judge phase takes half the infer phase's wall
    assert judge.wall_s == pytest.approx(infer.wall_s / 2, rel=0.05)
    assert infer.wall_s == pytest.approx(100_000 * 0.004 / 2, rel=0.05)
    assert res.pools["infer"]["replicas"] == 2 and res.pools["judge"]["replicas"] == 4
    assert res.gpu_s == pytest.approx(res.pools["infer"]["gpu_s"] + res.pools["judge"]["gpu_s"])
    assert res.pools["judge"]["gpu_s"] == pytest.approx(2 * res.pools["infer"]["gpu_s"])  # both held for the whole run


def test_the_tails_generation_and_judging_overlap_on_the_two_pools() -> None:
    """A retry task keeps two chunks in flight (pool.constants.TAIL_CHUNKS_IN_FLIGHT), the next
    generating while the one before is judged, so its judging on the judge pool runs beside
    its generation on the infer pool: with both models at the same cost the tail on two
    pools takes about half the wall of one pool's (each pool does half the work), plus the
    first chunk's generation before any judging. A one-chunk shard's parts take turns."""
    w = Workload(records=100_000, approval=1.0)
    cluster = Cluster(replicas=2, concurrency=5)
    one = simulate(spec("in_place", judge_engine=False), w, INFER, cluster=cluster, overheads=QUIET)
    tail_one = next(r for r in one.rounds if r.name == "tail")
    assert tail_one.wall_s == pytest.approx(100_000 * 0.008 / 2, rel=0.05)
    # four chunks a shard: the parts overlap; each task holds its slots for its first
    # chunk's generation too (1 s of a shard's 8 s here)
    two = simulate(spec("in_place", chunk_size=250), w, INFER, cluster=cluster, overheads=QUIET, judge_cluster=cluster,
                   judge_rates=JUDGE)
    tail_two = next(r for r in two.rounds if r.name == "tail")
    assert tail_one.wall_s / 2 < tail_two.wall_s <= 0.6 * tail_one.wall_s
    assert two.pools["infer"]["engine_s"] == pytest.approx(two.pools["judge"]["engine_s"], rel=0.01)
    assert two.gpu_s <= 1.2 * one.gpu_s  # twice the GPUs for a little over half the wall
    assert two.approved == one.approved == 100_000
    # one chunk a shard: they take turns, the same wall as on one pool and twice the GPU-seconds
    turns = simulate(spec("in_place", chunk_size=1_000), w, INFER, cluster=cluster, overheads=QUIET, judge_cluster=cluster,
                     judge_rates=JUDGE)
    assert next(r for r in turns.rounds if r.name == "tail").wall_s == pytest.approx(tail_one.wall_s, rel=0.05)
    assert turns.gpu_s == pytest.approx(2 * one.gpu_s, rel=0.05)


def test_plan_prices_the_judges_pool_apart(tmp_path: Path) -> None:
    import yaml

    from batch_inference.cli.plan_cmds import plan as plan_cmd
    from batch_inference_tests.pipeline.helpers import spec_dict

    data = spec_dict(tmp_path, records=2_000, strategy="hybrid", pool={"launcher": "local"})  # planned, never started
    data["engine"] = {"kind": "simulated", "simulated": {"approval_rate": 0.0, "latency_a_s": 0.002, "latency_b_s": 1e-5}}
    data["judge"] = {**data["judge"], "pool": {"replicas": 2},
                     "engine": {"kind": "simulated", "seed": 1, "simulated": {"approval_rate": 0.6, "latency_a_s": 0.002, "latency_b_s": 4e-5}}}
    p = make_plan(PipelineSpec.parse(data), gpu_hour_price=2.0)
    for s in p.strategies:
        assert set(s.pools) == {"infer", "judge"} and s.pools["judge"]["replicas"] == 2
        assert s.gpu_hours == pytest.approx(s.pools["infer"]["gpu_hours"] + s.pools["judge"]["gpu_hours"])
        assert s.cost == pytest.approx(2.0 * s.gpu_hours)
    assert any("approval per attempt: 0.600 (the simulated judge's approval_rate)" in a for a in p.assumptions)
    assert any(a.startswith("judge: its own model simulated:seed1 on pool default-judge") for a in p.assumptions)
    assert p.metadata()["plan.pool.judge.gpu_hours"] > 0
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    shown = CliRunner().invoke(plan_cmd, [str(path), "--gpu-hour-price", "2"], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    assert "GPU-h infer / judge" in shown.output and "busy)" in shown.output
