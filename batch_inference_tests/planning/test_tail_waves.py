"""The tail's waves priced at their own size: a chunk's wave is one engine call of that
chunk's records, so the call's fixed cost weighs on each record as the engine charges it
for a batch that size (not as for a full token-budget batch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from batch_inference.engines.base import SamplingParams
from batch_inference.engines.config import SimulatedOptions
from batch_inference.engines.simulated import LinearSimulatedEngine, simulated_completion, simulated_token_count
from batch_inference.pipeline import PipelineSpec
from batch_inference.planning.plan import judge_prompt_tokens, make_plan
from batch_inference.planning.rates import Workload

SIM = {"latency_a_s": 0.02, "latency_b_s": 1e-4, "output_tokens": 16, "output_lengths": "fixed"}


def spec(tmp_path: Path, *, records: int, approval: float, attempts: int, own: bool, concurrency: int = 4) -> PipelineSpec:
    # every prompt "Answer: question N" (N < 100) is 5 simulated tokens: the batch below is exact
    (tmp_path / "in.jsonl").write_bytes(b"".join(orjson.dumps({"prompt": f"question {i}"}) + b"\n" for i in range(records)))
    engine = {"kind": "simulated", "simulated": {**SIM, "approval_rate": approval}}
    judge: dict[str, Any] = {"kind": "llm", "template": "Judge: {result}", "max_tokens": 4}
    if own:
        judge["engine"] = {**engine, "seed": 1}
    return PipelineSpec.parse({
        "run": "waves", "input": str(tmp_path / "in.jsonl"), "output": str(tmp_path / "out"), "engine": engine,
        "infer": {"template": "Answer: {prompt}", "sampling": {"max_tokens": 16, "seed": 1}}, "judge": judge,
        "strategy": "in_place", "max_rounds": attempts, "max_attempts": attempts, "shard_records": 50, "chunk_size": 50,
        "pool": {"launcher": "inprocess", "concurrency": concurrency},
    })


def engine_says(prompt_tokens: int, output_tokens: int, n: int) -> float:
    """What the simulated linear engine itself charges for one batch of ``n`` such records."""
    engine = LinearSimulatedEngine(SimulatedOptions(**SIM))
    return engine.cost_s([prompt_tokens] * n, [output_tokens] * n)


def test_a_50_record_wave_costs_what_the_engine_charges_a_50_record_batch(tmp_path: Path) -> None:
    """Every record approved on its first attempt: the tail's one shard is one chunk of 50,
    generated in one wave, so the infer pool's engine time is one 50-record batch's."""
    assert engine_says(5, 16, 50) == pytest.approx(0.125)  # 20 ms + 50 x 21 tokens x 0.1 ms
    plan = make_plan(spec(tmp_path, records=50, approval=1.0, attempts=3, own=True), strategies=("in_place",))
    infer = plan.for_strategy("in_place").pools["infer"]
    assert infer["engine_hours"] * 3600 == pytest.approx(0.125, rel=1e-3)


def test_each_attempt_of_a_rejected_chunk_is_one_more_wave(tmp_path: Path) -> None:
    """Nothing ever approved, three attempts: three waves of all 50 records on the infer
    pool (3 x 0.125 s), where full 256-record batches would have priced 3 x 0.109 s."""
    plan = make_plan(spec(tmp_path, records=50, approval=0.0, attempts=3, own=True), strategies=("in_place",))
    infer = plan.for_strategy("in_place").pools["infer"]
    assert infer["engine_hours"] * 3600 == pytest.approx(0.375, rel=1e-3)


def test_one_engine_merges_the_waves_of_its_busy_slots(tmp_path: Path) -> None:
    """The judge on the infer engine, four shards on four slots, every record approved at
    once: each slot's generate wave waits beside the others', so the four go as one call
    (and so do the four judge waves): 2 calls' fixed cost, not 8."""
    one = make_plan(spec(tmp_path, records=50, approval=1.0, attempts=3, own=False), strategies=("in_place",))
    four = make_plan(spec(tmp_path, records=200, approval=1.0, attempts=3, own=False), strategies=("in_place",))
    tokens = 4 * (one.for_strategy("in_place").engine_s - 2 * 0.02)  # the one-shard run is 2 calls of 50 records
    assert four.for_strategy("in_place").engine_s == pytest.approx(tokens + 2 * 0.02, rel=1e-3)


def test_the_waves_a_chunk_goes_through() -> None:
    assert Workload(approval=0.0).tail_waves(3, 50, first=True) == pytest.approx(3)  # nobody ever approved
    assert Workload(approval=1.0).tail_waves(3, 50, first=True) == pytest.approx(1)  # all at once
    # one record: a wave per attempt it makes, 1 + 0.5 + 0.25
    assert Workload(approval=0.5).tail_waves(3, 1, first=True) == pytest.approx(1.75)


def test_the_judge_prompt_quotes_the_simulated_answer_as_its_tokenizer_counts_it(tmp_path: Path) -> None:
    """The simulated engine answers in words (one output token each), which its tokenizer
    counts at 4 characters a token: the planned judge prompt is what the engine counts in
    real judge prompts built from its real answers (within the rounding of one prompt)."""
    s = spec(tmp_path, records=10, approval=0.5, attempts=3, own=True)
    options = SimulatedOptions(**SIM)
    answers = [simulated_completion(f"Answer: question {i}", SamplingParams(max_tokens=16, seed=1), options, seed=0,
                                    max_model_len=4096).text for i in range(400)]
    counted = sum(simulated_token_count(f"Judge: {a}") for a in answers) / len(answers)
    assert judge_prompt_tokens(s, 5, 16) == pytest.approx(counted, abs=1.0)
    assert counted > 16 + 5  # more than the answer's 16 output tokens would say
