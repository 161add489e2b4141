"""The decode-step model and the two engines over it (blocking batches, continuous streaming)."""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import replace

import pytest
from pydantic import ValidationError

from batch_inference.engines import EngineConfig, EngineDeadError, SamplingParams, SimulatedOptions, build_engine, is_streaming
from batch_inference.engines.base import Engine
from batch_inference.engines.decode_model import DecodeScheduler, run_continuous
from batch_inference.engines.lengths import draw_output_tokens, record_rng
from batch_inference.engines.profiles import PROFILES, DecodeProfile
from batch_inference.engines.simulated import DecodeBatchEngine, DecodeStreamingEngine, LinearSimulatedEngine

PROFILE = DecodeProfile(
    name="test", step_s=1e-3, decode_token_s=1e-4, prefill_token_s=1e-5, kv_token_s=1e-7,
    kv_capacity_tokens=100_000, max_num_seqs=8, max_num_batched_tokens=4096,
)


def scheduler(**overrides: object) -> DecodeScheduler:
    return DecodeScheduler(replace(PROFILE, **overrides))


def test_step_time_is_the_stated_formula() -> None:
    assert PROFILE.step_time(10, 200, 5000) == pytest.approx(1e-3 + 10 * 1e-4 + 200 * 1e-5 + 5000 * 1e-7)


def test_one_request_takes_one_step_per_output_token() -> None:
    s = scheduler()
    s.add("a", 10, 5)
    first = s.step()  # prefill 10 tokens, first output token; 11 tokens in the cache
    assert first.prefill_tokens == 10 and first.decode_seqs == 0 and not first.finished
    assert first.duration_s == pytest.approx(PROFILE.step_time(0, 10, 11))
    durations = [s.step() for _ in range(4)]
    assert durations[-1].finished == ["a"] and s.idle and s.kv_used == 0
    assert [d.duration_s for d in durations] == pytest.approx([PROFILE.step_time(1, 0, 11 + k) for k in range(1, 5)])
    assert s.steps == 5 and s.output_tokens == 5
    assert s.busy_s == pytest.approx(s.now_s) == pytest.approx(first.duration_s + sum(d.duration_s for d in durations))


def test_max_num_seqs_bounds_the_running_batch() -> None:
    s = scheduler(max_num_seqs=3)
    for i in range(10):
        s.add(i, 5, 4)
    seen = []
    finished: list[object] = []
    while not s.idle:
        finished += s.step().finished
        seen.append(s.running)
        assert s.running <= 3
    assert max(seen) == 3 and sorted(finished) == list(range(10)) and s.output_tokens == 40


def test_kv_capacity_is_never_exceeded_and_preempted_requests_still_finish() -> None:
    s = scheduler(kv_capacity_tokens=200, max_num_seqs=64)
    outputs = {i: 20 + 7 * (i % 5) for i in range(30)}
    for i, n in outputs.items():
        s.add(i, 30, n)
    finished: list[object] = []
    while not s.idle:
        finished += s.step().finished
        assert s.kv_used <= 200
    assert sorted(finished) == sorted(outputs)
    assert s.output_tokens == sum(outputs.values())  # recomputation is prefill, not new output
    assert s.preemptions > 0  # the cache was the bound: admission alone could not prevent it


def test_a_request_larger_than_the_cache_is_refused() -> None:
    with pytest.raises(ValueError, match="exceed the KV cache"):
        scheduler(kv_capacity_tokens=100).add("big", 90, 20)


def test_abort_frees_the_sequence_and_its_cache() -> None:
    s = scheduler()
    s.add("long", 10, 1000)
    s.add("waiting", 10, 5)
    for _ in range(3):
        s.step()
    assert s.kv_used == 2 * 10 + 2 * 3
    assert s.abort("long") and "long" not in s and s.kv_used == 10 + 3
    assert not s.abort("long")
    finished = []
    while not s.idle:
        finished += s.step().finished
    assert finished == ["waiting"] and s.kv_used == 0


def test_step_token_budget_limits_prefill_per_step() -> None:
    s = scheduler(max_num_batched_tokens=100, max_num_seqs=64)
    for i in range(5):
        s.add(i, 40, 3)
    assert s.step().prefill_tokens == 80  # two prompts fit the budget, the third waits a step
    assert s.running == 2 and s.waiting == 3


def continuous_time(profile: DecodeProfile, outputs: list[int], prompt: int = 20) -> float:
    s = DecodeScheduler(profile)
    for i, n in enumerate(outputs):
        s.add(i, prompt, n)
    return s.run_until_idle()


def blocking_time(profile: DecodeProfile, outputs: list[int], batch: int, prompt: int = 20) -> float:
    return sum(continuous_time(profile, outputs[i : i + batch], prompt) for i in range(0, len(outputs), batch))


def test_barrier_batches_are_slower_than_continuous_batching_with_variable_lengths() -> None:
    profile = PROFILES["vllm-cpu-tiny"]
    outputs = [draw_output_tokens(record_rng("t", i), "geometric", 134, max_tokens=256) for i in range(1000)]
    cont = continuous_time(profile, outputs)
    blocking = blocking_time(profile, outputs, 32)
    assert sum(outputs) / cont > 2 * sum(outputs) / blocking  # calibrated: ~14.4k vs ~5.3k tok/s
    # equal lengths are the barrier's best case: a batch ends all at once
    fixed = [128] * 1024
    assert blocking_time(profile, fixed, 256) == pytest.approx(continuous_time(profile, fixed), rel=0.05)


def test_calibrated_tiny_profile_reproduces_the_measured_vllm_cpu_figures() -> None:
    """The fit in profiles.PROFILES, re-derived: 14,439 / 5,284 / 10,350-10,770 tok/s."""
    profile = PROFILES["vllm-cpu-tiny"]
    out256 = [draw_output_tokens(record_rng("cal", i), "geometric", 134, max_tokens=256) for i in range(3000)]
    assert sum(out256) / continuous_time(profile, out256) == pytest.approx(14_439, rel=0.03)
    assert sum(out256) / blocking_time(profile, out256, 32) == pytest.approx(5_284, rel=0.03)
    out192 = [draw_output_tokens(record_rng("cal", i), "geometric", 134, max_tokens=192) for i in range(2000)]
    assert 10_000 < sum(out192) / continuous_time(profile, out192, prompt=100) < 11_000


def test_h200_1b_profile_is_the_8b_arithmetic_at_the_small_models_sizes() -> None:
    """profiles.PROFILES["h200-llama-1b"], re-derived from its docstring's figures (nothing fitted)."""
    small, big = PROFILES["h200-llama-1b"], PROFILES["h200-llama-8b"]
    hbm = 0.8 * 4.8e12  # bytes/s read at ~80% of the H200's bandwidth
    assert small.step_s == pytest.approx(2.47e9 / hbm + 0.8e-3, rel=0.02)  # bf16 weights once a step + scheduling
    assert small.kv_token_s == pytest.approx(2 * 16 * 8 * 64 * 2 / hbm, rel=0.02)  # 32 KiB of KV a token
    assert small.decode_token_s == pytest.approx(big.decode_token_s * 1.24 / 8.03, rel=0.02)  # FLOPs a token
    assert small.prefill_token_s == small.decode_token_s / 2
    assert (small.max_num_seqs, small.max_num_batched_tokens) == (big.max_num_seqs, big.max_num_batched_tokens)
    # vLLM's throughput shape (~220 in, ~200 out, 1,000 prompts at once): ~4.3x the 8B model's output tok/s
    reqs = [(draw_output_tokens(record_rng("sharegpt", "p", i), "geometric", 220, max_tokens=8192),
             draw_output_tokens(record_rng("sharegpt", i), "geometric", 200, max_tokens=1024)) for i in range(1000)]
    ratio = run_continuous(small, reqs).tokens_per_s / run_continuous(big, reqs).tokens_per_s
    assert 4.0 < ratio < 4.6


# -- output lengths --------------------------------------------------------------


def test_lengths_are_seeded_per_record_and_follow_their_distribution() -> None:
    draws = {
        dist: [draw_output_tokens(record_rng(0, 1, f"p{i}"), dist, 100, max_tokens=100_000) for i in range(4000)]
        for dist in ("fixed", "geometric", "pareto")
    }
    assert set(draws["fixed"]) == {100}
    assert statistics.mean(draws["geometric"]) == pytest.approx(100, rel=0.08)
    assert statistics.median(draws["geometric"]) == pytest.approx(100 * 0.693, rel=0.1)
    assert max(draws["pareto"]) > 10 * max(draws["geometric"]) / 2  # the heavy tail
    assert draw_output_tokens(record_rng(0, 1, "p7"), "geometric", 100, max_tokens=100_000) == draws["geometric"][7]
    assert draw_output_tokens(record_rng(0, 1, "x"), "pareto", 1000, max_tokens=50, min_tokens=0) <= 50
    assert draw_output_tokens(record_rng(0, 1, "x"), "geometric", 2, max_tokens=50, min_tokens=40) >= 40


def test_a_records_length_does_not_depend_on_its_batch() -> None:
    e = DecodeBatchEngine(SimulatedOptions(cost_model="decode", scheduling="blocking", output_lengths="geometric",
                                           output_tokens=50, decode={"step_s": 0.0, "decode_token_s": 0.0,
                                                                     "prefill_token_s": 0.0}))
    prompts = [f"prompt {i}" for i in range(20)]
    alone = [e.generate([p], SamplingParams(max_tokens=500, seed=3))[0] for p in prompts]
    together = e.generate(prompts, SamplingParams(max_tokens=500, seed=3))
    assert alone == together
    assert len({c.completion_tokens for c in together}) > 5  # variable lengths
    assert together != e.generate(prompts, SamplingParams(max_tokens=500, seed=4))


# -- the engines -----------------------------------------------------------------


def decode_options(**kw: object) -> SimulatedOptions:
    decode = {"step_s": 2e-3, "decode_token_s": 0.0, "prefill_token_s": 0.0, "kv_token_s": 0.0, "max_num_seqs": 4}
    decode.update(kw.pop("decode", {}))  # type: ignore[arg-type]
    return SimulatedOptions(cost_model="decode", decode=decode, **kw)  # type: ignore[arg-type]


def test_factory_selects_the_model() -> None:
    linear = build_engine({"kind": "simulated"})
    assert isinstance(linear, LinearSimulatedEngine) and linear is not None
    assert isinstance(linear, Engine) and not is_streaming(linear) and "linear" in linear.name
    blocking = build_engine({"kind": "simulated", "simulated": {"cost_model": "decode", "scheduling": "blocking"}})
    assert isinstance(blocking, DecodeBatchEngine) and isinstance(blocking, Engine) and not is_streaming(blocking)
    cont = build_engine({"kind": "simulated", "simulated": {"cost_model": "decode", "profile": "h200-llama-8b"}})
    assert isinstance(cont, DecodeStreamingEngine) and is_streaming(cont) and cont.profile is PROFILES["h200-llama-8b"]
    over = build_engine(EngineConfig(kind="simulated", simulated=decode_options(decode={"max_num_seqs": 7})))
    assert over.profile.max_num_seqs == 7 and over.profile.name == "vllm-cpu-tiny"  # type: ignore[union-attr]
    assert over.capacity() == 14  # type: ignore[union-attr]


def test_config_rejects_unknown_profiles_and_fields() -> None:
    with pytest.raises(ValidationError, match="unknown simulated engine profile"):
        SimulatedOptions(cost_model="decode", profile="a100-nope")
    with pytest.raises(ValidationError, match="extra"):
        SimulatedOptions(decode={"kv_tokens": 5})
    with pytest.raises(ValueError, match="exceeds the profile's KV cache"):
        DecodeStreamingEngine(decode_options(decode={"kv_capacity_tokens": 100}), max_model_len=4096)


def test_blocking_engine_sleeps_its_longest_decode() -> None:
    e = DecodeBatchEngine(decode_options(scheduling="blocking", output_tokens=10))
    out = e.generate(["a", "b", "c"], SamplingParams(max_tokens=64))
    assert [c.completion_tokens for c in out] == [10, 10, 10]
    assert e.busy_s == pytest.approx(10 * 2e-3)  # 10 steps, whatever the batch size (max_num_seqs 4)
    e.generate(["a"] * 5, SamplingParams(max_tokens=64))
    assert e.busy_s == pytest.approx(10 * 2e-3 + 20 * 2e-3)  # the fifth waits for a free sequence slot


async def test_streaming_engine_completes_each_request_when_its_own_decode_ends() -> None:
    e = DecodeStreamingEngine(decode_options())
    await e.start()
    try:
        long = asyncio.ensure_future(e.complete("long", SamplingParams(max_tokens=40, min_tokens=40)))
        await asyncio.sleep(0.01)
        short = await e.complete("short", SamplingParams(max_tokens=3))
        assert short.completion_tokens == 3 and not long.done()  # joined the running batch, left first
        assert (await long).completion_tokens == 40
        assert e.occupancy().running == 0 and e.completed == 2 and e.output_tokens == 43
        # same text as the blocking engine and the linear one: answers do not depend on the model
        assert short == LinearSimulatedEngine(decode_options()).generate(["short"], SamplingParams(max_tokens=3))[0]
    finally:
        await e.aclose()


async def test_streaming_occupancy_and_admission_bound() -> None:
    e = DecodeStreamingEngine(decode_options(output_tokens=30))
    await e.start()
    try:
        tasks = [asyncio.ensure_future(e.complete(f"p{i}", SamplingParams(max_tokens=64))) for i in range(10)]
        await asyncio.sleep(0.02)
        occ = e.occupancy()
        assert occ.running == 4 and occ.waiting == 6 and occ.max_num_seqs == 4 and 0 < occ.kv_cache_usage < 1
        done = await asyncio.gather(*tasks)
        assert all(c.completion_tokens == 30 for c in done) and e.occupancy().running == 0
    finally:
        await e.aclose()


async def test_cancelling_a_request_aborts_it_in_the_engine() -> None:
    e = DecodeStreamingEngine(decode_options())
    await e.start()
    try:
        task = asyncio.ensure_future(e.complete("forever", SamplingParams(max_tokens=4000, min_tokens=4000)))
        await asyncio.sleep(0.02)
        assert e.occupancy().running == 1 and e.scheduler.kv_used > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert e.scheduler.idle and e.occupancy().running == 0 and e.scheduler.kv_used == 0
        assert (await e.complete("next", SamplingParams(max_tokens=2))).completion_tokens == 2
    finally:
        await e.aclose()


async def test_per_item_errors_never_enter_the_engine() -> None:
    e = DecodeStreamingEngine(decode_options(fail_on="POISON"), max_model_len=64)
    await e.start()
    try:
        bad = await e.complete("POISON pill", SamplingParams(max_tokens=4))
        long = await e.complete("x" * 400, SamplingParams(max_tokens=4))
        assert bad.error and bad.error.startswith("simulated_error")
        assert long.error and long.error.startswith("prompt_too_long")
        assert e.scheduler.steps == 0
    finally:
        await e.aclose()


async def test_a_dead_engine_raises_for_in_flight_and_later_requests() -> None:
    e = DecodeStreamingEngine(decode_options(die_after_requests=1))
    await e.start()
    try:
        first = asyncio.ensure_future(e.complete("a", SamplingParams(max_tokens=2)))
        second = asyncio.ensure_future(e.complete("b", SamplingParams(max_tokens=50, min_tokens=50)))
        assert (await first).completion_tokens == 2
        with pytest.raises(EngineDeadError):
            await second
        with pytest.raises(EngineDeadError):
            await e.complete("c", SamplingParams(max_tokens=2))
    finally:
        await e.aclose()


async def test_streaming_engine_must_be_started() -> None:
    with pytest.raises(RuntimeError, match="not started"):
        await DecodeStreamingEngine(decode_options()).complete("a", SamplingParams())


async def test_a_step_loop_that_dies_fails_waiting_and_later_requests() -> None:
    e = DecodeStreamingEngine(decode_options())
    await e.start()

    def broken_step() -> object:
        raise ValueError("KV accounting went negative")

    try:
        e.scheduler.step = broken_step  # type: ignore[method-assign]
        with pytest.raises(EngineDeadError, match="step loop died: ValueError: KV accounting"):
            await asyncio.wait_for(e.complete("a", SamplingParams(max_tokens=4)), 5)
        with pytest.raises(EngineDeadError, match="step loop died"):
            await asyncio.wait_for(e.complete("b", SamplingParams(max_tokens=4)), 5)
    finally:
        await e.aclose()


async def test_a_cancelled_step_loop_fails_waiting_requests() -> None:
    e = DecodeStreamingEngine(decode_options())
    await e.start()
    try:
        waiting = asyncio.ensure_future(e.complete("long", SamplingParams(max_tokens=4000, min_tokens=4000)))
        await asyncio.sleep(0.02)
        e.close()  # the sync close: cancels the loop
        with pytest.raises(EngineDeadError, match="step loop was cancelled"):
            await asyncio.wait_for(waiting, 5)
    finally:
        await e.aclose()
