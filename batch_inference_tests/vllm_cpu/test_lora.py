"""Real vLLM (the CPU build) with LoRA adapters on the tiny model: ``make test-vllm``.

One run whose infer phase runs on an adapter (``infer.adapter``) and whose judge runs on
the base model, with records that name their own adapter; every record's result is what
a direct ``LLM.generate`` with that record's ``LoRARequest`` (none: the base model) gives.
Two engine loads (the pipeline's, then the direct one), ~1-2 min on 2 cores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

pytest.importorskip("vllm")

from batch_inference.pipeline import PipelineSpec  # noqa: E402
from batch_inference_tests.pipeline.helpers import run_infer_on_adapter_judge_on_base  # noqa: E402

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.timeout(900)]  # two engine loads on a shared CPU

PROMPTS = ["The quick brown fox", "Question: what is the capital of France?", "Summarise the article in one",
           "Large language models generate", "def add(a, b):", "Translate the following sentence"]
# the record's own adapter: "-" names none (the phase's, infer.adapter a1), None the base model
CHOICES = ["-", "a2", None, "a1", "-", "a2"]
VLLM = {"enforce_eager": True, "extra": {"enable_chunked_prefill": False, "max_num_seqs": 16}}


async def test_an_adapter_infer_phase_and_a_base_model_judge_in_one_run(tmp_path: Path, tiny_model_dir: Path,
                                                                         tiny_adapters: dict[str, Path]) -> None:
    src = tmp_path / "input.jsonl"
    with open(src, "wb") as f:
        for i, (prompt, adapter) in enumerate(zip(PROMPTS, CHOICES)):
            rec: dict[str, Any] = {"id": f"r{i}", "prompt": prompt}
            if adapter != "-":
                rec["adapter"] = adapter
            f.write(orjson.dumps(rec) + b"\n")
    lora = {"adapters": {name: str(path) for name, path in tiny_adapters.items()}, "max_loras": 2}
    spec = PipelineSpec.parse({
        "run": "lora", "input": str(src), "output": str(tmp_path / "runs"),
        "engine": {"kind": "vllm", "model": str(tiny_model_dir), "dtype": "float32", "max_model_len": 512,
                   "vllm": {**VLLM, "lora": lora}},
        "infer": {"template": "{prompt}", "adapter": "a1", "sampling": {"max_tokens": 12, "temperature": 0.0}},
        "judge": {"kind": "llm", "template": "{prompt} {result} Reply APPROVED or REJECTED:", "max_tokens": 4},
        # one request in the engine at a time, as in the direct calls below: random weights leave the
        # logits nearly tied, so a batch of another shape could flip a greedy token on CPU
        "strategy": "rounds", "max_rounds": 1, "shard_records": 3, "chunk_size": 1,
        "pool": {"launcher": "inprocess", "concurrency": 1},
    })
    rows = await run_infer_on_adapter_judge_on_base(spec, records=6, adapter="a1")

    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(model=str(tiny_model_dir), dtype="float32", max_model_len=512, enforce_eager=True, enable_chunked_prefill=False,
              enable_lora=True, max_loras=2, max_lora_rank=8, seed=0)
    requests = {name: LoRARequest(name, i, str(path)) for i, (name, path) in enumerate(tiny_adapters.items(), start=1)}
    adapters = ["a1" if c == "-" else c for c in CHOICES]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    direct = [llm.generate([p], params, lora_request=requests.get(a) if a else None, use_tqdm=False)[0]
              for p, a in zip(PROMPTS, adapters)]
    base = [llm.generate([p], params, use_tqdm=False)[0] for p in PROMPTS]
    tokenizer = llm.get_tokenizer()
    for i, out in enumerate(direct):
        # the streaming engine decodes a request's ids once, at its end (random weights: partial
        # UTF-8 bytes, which vLLM's incremental detokenizer holds back): the same ids decoded alike
        want = tokenizer.decode(list(out.outputs[0].token_ids), skip_special_tokens=True)
        assert rows[f"r{i}"]["result"] == want, (i, adapters[i])
    # the adapters change the model's answers: the comparison is not the base model's against itself
    assert sum(list(d.outputs[0].token_ids) != list(b.outputs[0].token_ids) for d, b, a in zip(direct, base, adapters) if a) >= 3
