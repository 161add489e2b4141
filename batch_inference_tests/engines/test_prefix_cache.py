"""The prefix cache's blocks, the distinct-block sketch, and the decode model's LRU prefix cache."""

from __future__ import annotations

import asyncio
import random

import pytest

from batch_inference.engines import SamplingParams, build_engine
from batch_inference.engines.blocks import DistinctBlocks, block_keys, cacheable_blocks, chain_hashes, ids_signature
from batch_inference.engines.decode_model import DecodeScheduler, run_continuous
from batch_inference.engines.prefix_cache import PrefixCache
from batch_inference.engines.profiles import get_profile
from batch_inference.engines.simulated import simulated_encode


def test_block_hashes_name_their_whole_prefix_and_never_the_last_token() -> None:
    a = ids_signature(list(range(100)), 16)
    b = ids_signature(list(range(64)) + [7] * 36, 16)
    assert len(a) == 6 * 8 and cacheable_blocks(100, 16) == 6
    assert block_keys(a)[:4] == block_keys(b)[:4] and block_keys(a)[4] != block_keys(b)[4]
    assert ids_signature(list(range(96)), 16) == a[:5 * 8]  # 96 tokens: its 6th block holds the last token
    assert chain_hashes(b"x" * 32, 16) != chain_hashes(b"y" * 16 + b"x" * 16, 16)[:8] + chain_hashes(b"x" * 16, 16)


def test_distinct_blocks_is_exact_while_small_and_close_past_it() -> None:
    # seeded: the sketch's error is a random variable, and a test of its bound must not be one
    # (os.urandom failed the 5% bound once in a fast-tier run)
    rng = random.Random(20261203)
    small = DistinctBlocks()
    keys = [rng.randbytes(8) for _ in range(900)]
    small.add(b"".join(keys))
    small.add(b"".join(keys[:300]))
    assert small.estimate() == 900
    assert DistinctBlocks.from_text(small.to_text()).estimate() == 900
    big, other = DistinctBlocks(), DistinctBlocks()
    data = rng.randbytes(8 * 200_000)
    big.add(data[: 8 * 150_000])
    other.add(data[8 * 100_000:])
    assert abs(big.estimate() / 150_000 - 1) < 0.05
    big.merge(other)  # the union: 200,000 distinct
    assert abs(big.estimate() / 200_000 - 1) < 0.05
    again = DistinctBlocks.from_text(big.to_text())
    assert again.estimate() == big.estimate()
    mixed = DistinctBlocks()
    mixed.merge(small)
    mixed.merge(again)
    assert abs(mixed.estimate() / 200_900 - 1) < 0.05


def test_prefix_cache_pins_running_blocks_and_evicts_least_recently_used() -> None:
    cache = PrefixCache(16)
    a, b, c = [bytes([i]) * 8 for i in (1, 2, 3)]
    assert cache.admit([a, b], 40, preempted=False) == 0
    assert cache.lookup([a, b, c]) == 2 and cache.admit([a, c], 40, preempted=False) == 16
    cache.evict_to(0)
    assert cache.lookup([a]) == 1  # pinned by both running sequences
    cache.release([a, b])
    cache.evict_to(1)  # one free block may stay: b, the only unpinned one
    assert cache.lookup([a, b]) == 2
    cache.evict_to(0)  # b goes; a is still pinned by the second sequence
    assert cache.lookup([a, b]) == 1 and cache.lookup([a, c]) == 2
    cache.release([a, c])
    cache.evict_to(1)  # a and c free, a released first: the least recently used goes
    assert len(cache) == 1 and cache.lookup([a]) == 0
    assert (cache.requests, cache.queries, cache.hits) == (2, 80, 16)


def _family_requests(families: int, per: int, *, grouped: bool) -> list[tuple[int, int, list[bytes]]]:
    size = 16
    reqs = []
    for f in range(families):
        for q in range(per):
            ids = [f] * 480 + [1000 + q] * 20  # a 480-token family prefix, a 20-token question
            reqs.append((len(ids), 8, block_keys(ids_signature(ids, size))))
    if not grouped:
        reqs = [reqs[f * per + q] for q in range(per) for f in range(families)]
    return reqs


def test_a_scheduler_with_a_prefix_cache_does_not_prefill_cached_blocks() -> None:
    profile = get_profile("h200-llama-8b")
    reqs = _family_requests(8, 10, grouped=True)
    off = run_continuous(profile, [r[:2] for r in reqs], max_in_flight=16)
    on = run_continuous(profile, reqs, max_in_flight=16, cache=PrefixCache(profile.block_size))
    assert off.cached_tokens == 0 and off.prefill_tokens == sum(r[0] for r in reqs)
    assert on.cached_tokens == 8 * 9 * 480 + 8 * 0  # every question after the first hits its family's 30 blocks
    assert on.prefill_tokens == off.prefill_tokens - on.cached_tokens and on.seconds < off.seconds
    sched = DecodeScheduler(profile, PrefixCache(profile.block_size))
    sched.add("x", *reqs[0])
    sched.add("y", *reqs[1])
    result = sched.step()
    sched.run_until_idle()
    assert result.prefill_tokens == 500 + 20  # admitted in the same step, the second hits the first's blocks


def test_a_small_kv_cache_keeps_grouped_families_not_interleaved_ones() -> None:
    from dataclasses import replace

    profile = replace(get_profile("h200-llama-8b"), kv_capacity_tokens=4_000, max_num_seqs=4)
    grouped = run_continuous(profile, _family_requests(12, 6, grouped=True), max_in_flight=4, cache=PrefixCache(16))
    mixed = run_continuous(profile, _family_requests(12, 6, grouped=False), max_in_flight=4, cache=PrefixCache(16))
    assert grouped.cached_tokens > 2 * mixed.cached_tokens and grouped.seconds < mixed.seconds


@pytest.mark.parametrize("scheduling", ["continuous", "blocking"])
def test_the_simulated_engine_reports_its_prefix_cache_as_vllm_does(scheduling: str) -> None:
    engine = build_engine({"kind": "simulated", "simulated": {"cost_model": "decode", "scheduling": scheduling,
                                                               "prefix_cache": True, "decode": {"step_s": 1e-5}}})
    doc = "the shared document " * 40  # 800 characters: 200 tokens, one 128-token block cacheable
    prompts = [simulated_encode(doc + f"question {i}") for i in range(6)]
    assert engine.prefix_block_size == 128 and len(engine.prefix_signature(prompts[0])) == 8

    async def run() -> list:
        await engine.start()
        try:
            first = await engine.complete(prompts[0], SamplingParams(max_tokens=4))
            rest = await asyncio.gather(*(engine.complete(p, SamplingParams(max_tokens=4)) for p in prompts[1:]))
            return [first, *rest]
        finally:
            await engine.aclose()

    if scheduling == "continuous":
        out = asyncio.run(run())
    else:
        out = engine.generate(prompts[:1], SamplingParams(max_tokens=4)) + engine.generate(prompts[1:], SamplingParams(max_tokens=4))
    assert [c.cached_tokens for c in out] == [0] + [128] * 5
    stats = engine.prefix_cache()
    assert (stats.requests, stats.hits, stats.queries) == (6, 5 * 128, sum(c.prompt_tokens for c in out))
    plain = build_engine({"kind": "simulated", "simulated": {"cost_model": "decode", "scheduling": scheduling}})
    assert plain.prefix_block_size is None and plain.prefix_cache() is None


def test_prefix_cache_needs_the_decode_model() -> None:
    with pytest.raises(ValueError, match="needs cost_model 'decode'"):
        build_engine({"kind": "simulated", "simulated": {"prefix_cache": True}})
