"""bench/_limit.py: the throughput limit's request order and the ratios the shape benches report."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
_limit = pytest.importorskip("_limit")


def test_limit_order_runs_each_distinct_request_once_with_shared_prefixes_adjacent() -> None:
    ids = [[5, 1, 9], [7, 2], [5, 1, 3], [7, 2], [5, 1, 9], [5, 1]]  # interleaved families, exact repeats
    order = _limit.limit_order(ids)
    assert order == [[5, 1], [5, 1, 3], [5, 1, 9], [7, 2]]  # duplicates once; a prefix before what extends it


def test_against_limit_reports_the_phase_alone_and_with_the_shard_step() -> None:
    limit = {"records_s": 100.0}
    run = {"records": 240, "seconds": 3.0, "shard_s": 1.0}
    got = _limit.against_limit(run, limit)
    assert got["records_s"] == pytest.approx(80.0) and got["of_limit"] == pytest.approx(0.8)
    assert got["records_s_shard"] == pytest.approx(60.0) and got["of_limit_shard"] == pytest.approx(0.6)
    assert _limit.against_limit({"records": 240, "seconds": 3.0}, limit)["of_limit_shard"] == pytest.approx(0.8)  # raw: no shard step


def test_step_counters_summarise_the_scheduler_updates_with_a_request_running() -> None:
    from types import SimpleNamespace as NS

    c = _limit.StepCounters()
    prefix = NS(queries=100, hits=75, preempted_requests=1)
    for running, waiting, flight in ((0, 0, 0), (4, 6, 10), (8, 2, 10), (6, 0, 6)):
        c.add(NS(num_running_reqs=running, num_waiting_reqs=waiting, prefix_cache_stats=prefix), flight)
    c.add(None)  # an update without scheduler figures counts nothing
    s = c.summary()
    assert (s["steps"], s["running_max"], s["running_p50"], s["preempted"]) == (3, 8, 6, 4)
    assert s["running_mean"] == pytest.approx(6.0) and s["waiting_mean"] == pytest.approx(8 / 3)
    assert s["in_flight_mean"] == pytest.approx(26 / 3) and s["hit_share"] == pytest.approx(0.75)
    c.reset()
    assert c.summary()["steps"] == 0 and c.summary()["in_flight_mean"] is None


def test_the_benches_pipeline_spec_turns_the_result_cache_off(tmp_path: Path) -> None:
    """Every measurement reruns the same prompts in one output folder: a cache hit would time the cache."""
    _raw_vllm = pytest.importorskip("_raw_vllm")
    data = tmp_path / "in.jsonl"
    data.write_text('{"id": "a", "prompt": "hi"}\n')
    spec = _raw_vllm.pipeline_spec(engine={"kind": "simulated"}, root=tmp_path, run="r", data=data, infer={},
                                   shard_records=10, launcher="inprocess")
    assert spec.cache.enabled is False and spec.result_cache_url is None


def test_the_stop_string_variant_asks_every_path_for_at_most_the_output_and_the_same_stops(tmp_path: Path) -> None:
    """``workload_aware.py --stop``: no ``min_tokens`` anywhere (it would keep a stop string from ending
    a record), the records' own sampling and the spec's stop strings give the pipeline raw's request."""
    import orjson

    wa = pytest.importorskip("workload_aware")
    assert wa.sampling_kwargs(32, None) == {"max_tokens": 32, "min_tokens": 32}
    assert wa.sampling_kwargs(32, ["Through"]) == {"max_tokens": 32, "stop": ["Through"]}
    data = tmp_path / "in.jsonl"
    wa.write_input(data, [{"id": "r0", "prompt": "hi"}], 32, ["Through"])
    assert orjson.loads(data.read_bytes())["sampling"] == {"max_tokens": 32}
    (tmp_path / "m").mkdir()
    spec = wa.pipeline_spec(str(tmp_path / "m"), 100, tmp_path, "r", data, 1, 32, prefix=True, stop=["Through"])
    assert spec.infer.sampling.stop == ("Through",) and spec.infer.sampling.max_tokens == 32
    wa.write_input(data, [{"id": "r0", "prompt": "hi"}], 32)
    assert orjson.loads(data.read_bytes())["sampling"] == {"max_tokens": 32, "min_tokens": 32}
    assert wa.texts_digest(["a", None]) == wa.texts_digest(["a", None]) != wa.texts_digest(["a", ""])


def test_the_short_request_shapes_have_the_records_asked_for_with_exact_repeats_and_short_prompts(tmp_path: Path) -> None:
    """Issue 41's short shapes: documents x 6 questions with 20% exact repeats, and 4 copies of
    100-700-token prompts; ``--signature`` reaches the pipeline's ``layout.signature``."""
    import random

    wa = pytest.importorskip("workload_aware")
    for shape, distinct in (("short_questions", 2400), ("mid_questions", 2400), ("short_repeats", 720)):
        recs = wa.build(shape, 2880, random.Random(1))
        prompts = [r["prompt"] for r in recs]
        assert len(recs) == 2880 and len({r["id"] for r in recs}) == 2880 and len(set(prompts)) == distinct, shape
    short = wa.build("short_questions", 2880, random.Random(1))
    assert max(len(r["prompt"]) for r in short) < 600  # ~170 tokens of the tiny model (~1.7 characters a token)
    (tmp_path / "m").mkdir()
    data = tmp_path / "in.jsonl"
    wa.write_input(data, short[:4], 4)
    spec = wa.pipeline_spec(str(tmp_path / "m"), 100, tmp_path, "r", data, 4, 4, prefix=True, signature="tokens")
    assert spec.layout.signature == "tokens"
    assert wa.pipeline_spec(str(tmp_path / "m"), 100, tmp_path, "r", data, 4, 4, prefix=True).layout.signature == "auto"
