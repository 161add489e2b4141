"""The simulated engine: cost model, determinism, approval rate, fault injection."""

from __future__ import annotations

import time

import pytest

from batch_inference.engines import SamplingParams, SimulatedOptions
from batch_inference.engines.simulated import LinearSimulatedEngine, SimulatedBatchError, simulated_token_count


def engine(**opts) -> LinearSimulatedEngine:
    return LinearSimulatedEngine(SimulatedOptions(**{"latency_a_s": 0.0, "latency_b_s": 0.0, **opts}))


def test_cost_model_linear_in_tokens_and_padded() -> None:
    e = engine(latency_a_s=0.01, latency_b_s=0.001)
    assert e.cost_s([10, 20], [5, 5]) == pytest.approx(0.01 + 0.001 * 40)
    assert e.cost_s([10, 20, 30], [5, 5, 5]) > e.cost_s([10, 20], [5, 5])
    padded = engine(latency_a_s=0.01, latency_b_s=0.001, padded=True)
    assert padded.cost_s([10, 20], [5, 5]) == pytest.approx(0.01 + 0.001 * 2 * 25)
    assert e.cost_s([], []) == 0.0


def test_generate_sleeps_the_modelled_time() -> None:
    e = engine(latency_a_s=0.05, latency_b_s=0.0)
    start = time.perf_counter()
    e.generate(["a", "b"], SamplingParams())
    assert time.perf_counter() - start >= 0.05  # a lower bound only: sleep never returns early
    assert e.busy_s == pytest.approx(0.05) and e.calls == 1


def test_deterministic_in_prompt_and_seed() -> None:
    e = engine()
    prompts = [f"prompt {i}" for i in range(20)]
    a = e.generate(prompts, SamplingParams(seed=1))
    assert a == e.generate(prompts, SamplingParams(seed=1))
    assert a == engine().generate(prompts, SamplingParams(seed=1))  # across instances (no process hash salt)
    assert a != e.generate(prompts, SamplingParams(seed=2))
    assert a[3] == e.generate([prompts[3]], SamplingParams(seed=1))[0]  # batch composition does not matter


def test_output_length_and_token_counts() -> None:
    e = engine(output_tokens=8)
    c = e.generate(["hello world!"], SamplingParams(max_tokens=5))[0]
    assert c.completion_tokens == 5 == len(c.text.split()) and c.finish_reason == "length"
    c = e.generate(["hello world!"], SamplingParams(max_tokens=64))[0]
    assert c.completion_tokens == 8 and c.finish_reason == "stop"
    assert c.prompt_tokens == simulated_token_count("hello world!") == 3
    assert e.count_tokens(["", "abcd", "abcde"]) == [1, 1, 2]


@pytest.mark.parametrize("rate", [0.0, 0.3, 1.0])
def test_approval_rate(rate: float) -> None:
    e = engine(approval_rate=rate)
    out = e.generate([f"judge {i}" for i in range(2000)], SamplingParams(seed=7))
    approved = sum(c.text.startswith("APPROVED") for c in out)
    assert all(c.text.split()[0] in ("APPROVED", "REJECTED") for c in out)
    assert approved / 2000 == pytest.approx(rate, abs=0.04)


def test_fault_injection_and_length_errors() -> None:
    e = LinearSimulatedEngine(SimulatedOptions(latency_a_s=0, latency_b_s=0, fail_on="POISON", fail_batch_every=3), max_model_len=20)
    out = e.generate(["ok", "has POISON", "x" * 100], SamplingParams(max_tokens=4))
    assert out[0].error is None and out[0].finish_reason != "error"
    assert out[1].finish_reason == "error" and "POISON" in (out[1].error or "")
    assert (out[2].error or "").startswith("prompt_too_long")
    e.generate(["ok"], SamplingParams())
    with pytest.raises(SimulatedBatchError):
        e.generate(["ok"], SamplingParams())
    e.generate(["ok"], SamplingParams())  # the 4th call works again


def test_stop_strings() -> None:
    e = engine(approval_rate=1.0)
    c = e.generate(["p"], SamplingParams(stop=[" "]))[0]
    assert c.text == "APPROVED" and c.finish_reason == "stop" and c.completion_tokens == 1
