"""Real vLLM (the CPU build): count_tokens never shares generate's tokenizer, so counting
from worker threads while generate runs neither races nor changes the counts."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from batch_inference.engines import SamplingParams  # noqa: E402
from batch_inference.engines.chat import TokenizerCopy  # noqa: E402
from batch_inference.engines.config import EngineConfig  # noqa: E402
from batch_inference.engines.vllm_engine import VllmEngine  # noqa: E402

pytestmark = pytest.mark.vllm_cpu


def test_count_tokens_on_its_own_tokenizer_while_generate_runs(tiny_model_dir: Path) -> None:
    cfg = EngineConfig(kind="vllm", model=str(tiny_model_dir), dtype="float32", max_model_len=512,
                       vllm={"enforce_eager": True, "extra": {"enable_chunked_prefill": False, "max_num_seqs": 16}})
    engine = VllmEngine(cfg)
    try:
        copies = [v for v in vars(engine).values() if isinstance(v, TokenizerCopy)]
        assert len(copies) == 1 and copies[0].tokenizer is not engine.tokenizer
        prompts = ["hello there", "The quick brown fox jumps over the lazy dog."] * 8
        expected = [len(engine.tokenizer.encode(p)) for p in prompts]
        params = SamplingParams(max_tokens=16, min_tokens=16)
        with ThreadPoolExecutor(4) as pool:
            counted = [pool.submit(lambda: [engine.count_tokens(prompts) for _ in range(20)]) for _ in range(3)]
            generated = pool.submit(lambda: [engine.generate(prompts, params) for _ in range(3)])
            assert all(c == expected for f in counted for c in f.result())
            assert all(c.error is None and c.prompt_tokens == n for out in generated.result() for c, n in zip(out, expected))
    finally:
        engine.close()
