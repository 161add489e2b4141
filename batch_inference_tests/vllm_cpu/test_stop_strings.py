"""Real vLLM (the CPU build): stop strings through the streaming engine are raw ``LLM.generate``'s.

With stop strings the streaming engine asks vLLM for its final output only, with vLLM's own
incremental detokenizer looking for them at every step (docs/engines.md): the texts, token
counts and finish reasons must be exactly those of one ``LLM.generate`` of the same token
ids and sampling (issue 32 item 4 measures the pipeline against that call). Two engine loads
(the streaming one, closed, then the offline one: two in one process hung here), ~1-2 min.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from batch_inference.engines import EngineConfig, SamplingParams  # noqa: E402
from batch_inference.engines.vllm_engine import engine_kwargs, vllm_sampling_kwargs  # noqa: E402
from batch_inference.pool.engine_host import EngineHost  # noqa: E402
from batch_inference.pool.request import GenRequest  # noqa: E402

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.timeout(900)]

VOCAB = "the quick brown fox jumps over a lazy dog while seven wizards quietly box near rivers mountains".split()
STOP = ("ugh", "Through")  # the tiny model's greedy gibberish has them in some outputs, not in most


def config(model: Path) -> dict:
    return {"kind": "vllm", "model": str(model), "dtype": "float32", "max_model_len": 512,
            "vllm": {"enforce_eager": True, "extra": {"enable_chunked_prefill": False, "max_num_seqs": 16}}}


async def test_stop_strings_end_requests_exactly_where_llm_generate_ends_them(tiny_model_dir: Path) -> None:
    rng = random.Random(3)
    prompts = [f"{rng.randrange(10**9)} " + " ".join(rng.choice(VOCAB) for _ in range(40)) + "\nAnswer:" for _ in range(32)]
    params = SamplingParams(max_tokens=24, temperature=0.0, stop=STOP)
    async with EngineHost(config(tiny_model_dir)) as host:
        assert host.streaming
        tokens = host.engine.encode(prompts)
        futures = await host.submit([GenRequest(t, params, 0) for t in tokens])
        streamed = list(await asyncio.gather(*futures))

    from vllm import LLM
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**engine_kwargs(EngineConfig.model_validate(config(tiny_model_dir))))
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(t.ids)) for t in tokens],
                        sampling_params=VllmSamplingParams(**vllm_sampling_kwargs(params)), use_tqdm=False)
    raw = [(o.outputs[0].text, len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]
    assert [(c.text, c.completion_tokens, c.finish_reason) for c in streamed] == raw
    reasons = [r[2] for r in raw]
    assert "stop" in reasons and "length" in reasons, reasons  # the stop strings ended some requests, not all
    assert all(not any(s in text for s in STOP) for text, _, _ in raw)  # cut before the stop string
    # which stop string ended each request: vLLM's stop_reason, carried as Completion.stop_sequence
    matched = [o.outputs[0].stop_reason if isinstance(o.outputs[0].stop_reason, str) else None for o in outs]
    assert [c.stop_sequence for c in streamed] == matched and set(matched) - {None} <= set(STOP) and any(matched)
