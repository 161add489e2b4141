"""Real vLLM (the CPU build): the tiny embedding model on vLLM's pooling runner (``LLM.embed``),
through the pool's engine host as the pipeline drives it, against the transformers engine's vectors."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")

from batch_inference.engines import SamplingParams, build_engine  # noqa: E402
from batch_inference.engines.pooling import VllmEmbedEngine  # noqa: E402
from batch_inference.pool.engine_host import EngineHost  # noqa: E402
from batch_inference.pool.request import GenRequest  # noqa: E402

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.timeout(900)]


def test_vllm_embeds_the_tiny_model_as_transformers_does(tiny_embed_dir: Path) -> None:
    texts = [f"passage {i}: the quick brown fox jumps over the lazy dog" + " again" * i for i in range(12)]
    ref = build_engine({"kind": "transformers", "model": str(tiny_embed_dir), "task": "embed", "device": "cpu"})
    want = ref.generate(ref.encode(texts), SamplingParams(embed=True))
    config = {"kind": "vllm", "model": str(tiny_embed_dir), "task": "embed", "dtype": "float32", "max_model_len": 256,
              "vllm": {"enforce_eager": True, "streaming": True}}

    async def run() -> list:
        async with EngineHost(config) as host:
            assert isinstance(host.engine, VllmEmbedEngine)  # embed is blocking even with streaming on: the batcher feeds it
            encoded = host.engine.encode(texts)
            params = [SamplingParams(embed=True)] * len(texts) + [SamplingParams(embed=True, dimensions=32),
                                                                  SamplingParams(embed=True, dimensions=33)]
            encoded += [encoded[0], encoded[0]]
            futures = await host.submit([GenRequest(t, p, len(t.ids)) for t, p in zip(encoded, params)])
            return list(await asyncio.gather(*futures))

    got = asyncio.run(run())
    for g, w in zip(got, want):
        assert g.error is None and g.prompt_tokens == w.prompt_tokens
        assert np.allclose(g.embedding, w.embedding, atol=1e-3)  # same pooling (mean) and normalisation, read from the model's files
    assert len(got[-2].embedding) == 32 and np.isclose(np.linalg.norm(got[-2].embedding), 1.0, atol=1e-5)
    assert got[-1].error is not None and got[-1].error.startswith("bad_request: dimensions 33")
