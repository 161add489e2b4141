"""The planner's calibration: a sample drawn across the input, a profile that fills the
pool's slots, approval measured apart for first and later attempts, and a band."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from batch_inference.pipeline import PipelineSpec
from batch_inference.planning.plan import make_plan
from batch_inference.planning.profiling import run_measure_profile
from batch_inference.planning.rates import Workload
from batch_inference.planning.sizing import input_size
from batch_inference.storage import JsonlDir


def rows(n: int) -> list[dict]:
    """Records sorted by kind, as real inputs often are: the easy half first."""
    return [{"id": str(i), "prompt": f"question number {i}", "kind": "easy" if i < n // 2 else "hard"} for i in range(n)]


def spec_for(tmp_path: Path, src: str, **kw: object) -> PipelineSpec:
    return PipelineSpec.parse({
        "run": "calibrate", "input": src, "output": str(tmp_path / "out"),
        "engine": {"kind": "simulated", "simulated": {"output_tokens": 8, "latency_a_s": 0.0, "latency_b_s": 1e-6}},
        "infer": {"template": "Q: {prompt}", "sampling": {"max_tokens": 8, "seed": 1}},
        # approval depends on the record, not on the attempt: a hard record stays rejected
        "judge": {"kind": "rule", "callable": "regex", "kwargs": {"pattern": "^easy$", "field": "kind"}},
        "strategy": "hybrid", "max_rounds": 3, "max_attempts": 3, "shard_records": 100, "chunk_size": 50,
        "pool": {"concurrency": 4, "retries": 0}, **kw,
    })


def test_a_sample_of_a_file_is_drawn_across_it_and_repeats(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows(1_000)))
    spec = spec_for(tmp_path, str(src))
    size = input_size(spec, sample=100)
    kinds = [r["kind"] for r in size.sample]
    assert size.records == 1_000 and len(kinds) == 100
    assert 30 <= kinds.count("hard") <= 70  # the first 100 records would all be easy
    assert [int(r["id"]) for r in size.sample] == sorted(int(r["id"]) for r in size.sample)  # input order
    assert input_size(spec, sample=100).sample == size.sample


def test_a_sample_of_a_manifest_directory_reads_shards_spread_over_it(tmp_path: Path) -> None:
    d = JsonlDir(str(tmp_path / "sharded"))
    with d.writer_sync(max_records_per_shard=50) as w:
        w.write_many(rows(2_000))  # 40 shards
    size = input_size(spec_for(tmp_path, d.url), sample=160)
    assert size.how == "manifest" and size.records == 2_000
    assert size.sampled == "16 of 40 shards, evenly spaced"
    ids = {int(r["id"]) for r in size.sample}
    assert len(size.sample) == 160 and min(ids) < 50 and max(ids) >= 1_950  # the first and the last shard


def test_attempts_with_a_later_approval_apart_from_the_first() -> None:
    independent = Workload(approval=0.5)
    assert independent.attempts(2, first=True) == pytest.approx((1.5, 0.75))
    stuck = Workload(approval=0.5, retry_approval=0.0)  # a rejected record never passes later
    assert stuck.attempts(3, first=True) == pytest.approx((2.0, 0.5))
    assert stuck.attempts(3, first=False) == pytest.approx((3.0, 0.0))
    assert Workload(approval=0.9, retry_approval=0.2).attempts(0, first=True) == (0.0, 0.0)


def test_the_profile_fills_the_slots_and_measures_later_approval(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows(800)))
    spec = spec_for(tmp_path, str(src), strategy="rounds")
    prof = run_measure_profile(spec, records=400, workdir=str(tmp_path / "work"))
    m = prof.measured
    assert m["slots"] == 4 and m["shard_records"] == 100  # 400 records in 4 shards: one wave over the 4 slots
    assert prof.approval == pytest.approx(0.5, abs=0.1)  # the sample holds both halves of the sorted input
    assert prof.retry_approval == 0.0  # round 1 judged only records rejected once: none passes
    hard = sum(1 for r in input_size(spec, sample=400).sample[::2] if r["kind"] == "hard")
    assert m["tail_attempts"] == 200 + hard  # read from the tail's rows: 1 per easy record, 2 per hard one
    plan = make_plan(spec, profile=prof, strategies=("rounds",))
    rounds = plan.for_strategy("rounds")
    # independence would leave (1 - a)^3 unfinished; a measured later approval of 0 leaves every hard record
    assert rounds.unfinished == pytest.approx(400, abs=40)
    assert any("0.000 on a later one" in a for a in plan.assumptions)
    low, high = rounds.wall_band_s
    assert low <= rounds.wall_s <= high and any(a.startswith("band:") for a in plan.assumptions)
    assert plan.metadata()["plan.wall_s.low"] == round(low, 1)


def test_a_profile_measures_engine_work_whatever_the_result_cache_holds(tmp_path: Path) -> None:
    """An earlier run's answers in the result cache would answer the profile's attempts at the
    cost of a file read: a profile never reads the cache (nor fills it), so a warm cache and a
    cold one measure the same engine, and the plan says it prices no hit."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows(160)))
    engine = {"kind": "simulated", "simulated": {"output_tokens": 8, "latency_a_s": 0.004, "latency_b_s": 2e-5}}

    def spec(cache: Path, run: str = "calibrate") -> PipelineSpec:
        return spec_for(tmp_path, str(src), engine=engine, run=run, cache={"url": str(cache)})

    def entries(cache: Path) -> dict[str, float]:
        """Each stored key's last use (a hit refreshes it)."""
        import contextlib
        import sqlite3

        if not (cache / "entries.sqlite3").exists():
            return {}
        with contextlib.closing(sqlite3.connect(cache / "entries.sqlite3")) as conn:
            return dict(conn.execute("SELECT key, used FROM entries"))

    warm_cache, cold_cache = tmp_path / "warm-cache", tmp_path / "cold-cache"
    from batch_inference.pipeline import run_pipeline

    earlier = asyncio.run(run_pipeline(spec(warm_cache, "earlier")))  # every record, every attempt the profile makes
    assert earlier.result_cache["entries"] > 160
    before = entries(warm_cache)
    warm = run_measure_profile(spec(warm_cache), records=80, workdir=str(tmp_path / "work-warm"))
    assert entries(warm_cache) == before  # nothing read (a hit refreshes its mtime) and nothing added
    cold = run_measure_profile(spec(cold_cache), records=80, workdir=str(tmp_path / "work-cold"))
    assert entries(cold_cache) == {}
    # the same engine, within a generous factor (not judge_s: this spec's rule judge takes ~0.1 ms a
    # record, which the cache never touches and a loaded machine's noise swamps)
    for measured in ("infer_s", "tail_attempt_s"):
        assert getattr(cold, measured) / 3 <= getattr(warm, measured) <= getattr(cold, measured) * 3, measured
    # an in-place attempt infers a record (and judges it): never priced at a cache read's cost
    assert warm.tail_attempt_s >= 0.5 * warm.infer_s and cold.tail_attempt_s >= 0.5 * cold.infer_s
    plan = make_plan(spec(warm_cache), profile=warm, strategies=("hybrid",))
    assert any(a.startswith("result cache: no hit priced") for a in plan.assumptions)
