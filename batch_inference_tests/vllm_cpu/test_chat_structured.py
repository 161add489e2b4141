"""Real vLLM (the CPU build): chat prompts are exactly the chat template's tokens, and
structured output returns schema-valid JSON for every record. ``make test-vllm``; skipped
where vllm is absent (the main venv)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from batch_inference.engines import ChatPrompt, ResponseFormat, SamplingParams  # noqa: E402
from batch_inference.engines.config import EngineConfig  # noqa: E402
from batch_inference.engines.vllm_engine import VllmEngine  # noqa: E402
from batch_inference.judges.llm import VERDICT_FORMAT, parse_json_verdict  # noqa: E402

pytestmark = pytest.mark.vllm_cpu

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["answer", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    cfg = EngineConfig(kind="vllm", model=str(tiny_model_dir), dtype="float32", max_model_len=512,
                       vllm={"enforce_eager": True, "extra": {"enable_chunked_prefill": False, "max_num_seqs": 16}})
    e = VllmEngine(cfg)
    yield e
    e.close()


def _valid(value: object) -> bool:
    return (isinstance(value, dict) and set(value) == {"answer", "ok"}
            and isinstance(value["answer"], int) and not isinstance(value["answer"], bool) and isinstance(value["ok"], bool))


def test_chat_tokens_equal_apply_chat_template(engine: VllmEngine, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    chats = [ChatPrompt((("system", "be brief"), ("user", f"question {i}?"))) for i in range(5)]
    for chat in chats:
        want = hf.apply_chat_template(chat.as_dicts(), add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want)
        assert list(engine.encode([chat])[0].ids) == want
    out = engine.generate(chats, SamplingParams(max_tokens=4, min_tokens=4))
    assert all(c.error is None and c.completion_tokens == 4 for c in out)
    assert [c.prompt_tokens for c in out] == engine.count_tokens(chats)


def test_structured_output_is_schema_valid_for_every_record(engine: VllmEngine) -> None:
    fmt = ResponseFormat("json_schema", json.dumps(SCHEMA, sort_keys=True))
    prompts = [f"Record {i}: reply as JSON" for i in range(24)]
    params = [SamplingParams(max_tokens=256, temperature=1.0, seed=i, response_format=fmt) for i in range(24)]
    out = engine.generate(prompts, params)
    assert all(c.error is None and c.finish_reason == "stop" for c in out), [(c.error, c.finish_reason) for c in out]
    values = [json.loads(c.text) for c in out]  # random weights, constrained: every reply parses
    assert all(_valid(v) for v in values), [c.text for c in out]


def test_json_verdict_judge_on_vllm(engine: VllmEngine) -> None:
    out = engine.generate([f"Judge answer {i}" for i in range(8)],
                          SamplingParams(max_tokens=256, temperature=1.0, seed=1, response_format=VERDICT_FORMAT))
    verdicts = [parse_json_verdict(c.text) for c in out]
    assert all(c.error is None for c in out) and all(v.reason != "unparseable_verdict" for v in verdicts), [c.text for c in out]


async def test_constrained_records_through_an_infer_task(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The pool's task path: every record schema-valid, or (cut by max_tokens) an error, never bad JSON."""
    from batch_inference.pool import InferConfig, InProcessPool
    from batch_inference.storage import JsonlFile
    from batch_inference_tests.fixtures.pool import infer_spec, read_rows

    src = tmp_path / "in.jsonl"
    with JsonlFile(str(src)).writer_sync() as w:
        w.write_many([{"id": f"r{i}", "messages": [{"role": "user", "content": f"record {i}"}]} for i in range(12)])
    infer = InferConfig(sampling={"max_tokens": 256, "temperature": 1.0, "seed": 5},
                        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    cfg = {"kind": "vllm", "model": str(tiny_model_dir), "dtype": "float32", "max_model_len": 512,
           "vllm": {"enforce_eager": True, "extra": {"enable_chunked_prefill": False, "max_num_seqs": 16}}}
    async with InProcessPool(cfg, concurrency=1) as pool:
        result = await pool.run_task(infer_spec("so", src, tmp_path / "out.jsonl", infer=infer))
    rows = read_rows(tmp_path / "out.jsonl")
    assert len(rows) == 12 and result.counts["ok"] == 12, [r["error"] for r in rows if r["error"]]
    assert all(_valid(json.loads(r["result"])) for r in rows)


# A review-label schema: an enum, an integer range, an array of short strings (length-bounded
# strings are where xgrammar admits raw control characters).
REVIEW_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["label", "score", "tags"],
                 "properties": {"label": {"enum": ["good", "bad", "unsure"]},
                                "score": {"type": "integer", "minimum": 1, "maximum": 5},
                                "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 8}}}}


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
async def test_every_approved_result_of_a_run_satisfies_its_schema(tiny_model_dir: Path, tmp_path: Path, backend: str) -> None:
    """60 records, json_schema, a judge that approves any text. xgrammar admits raw control
    characters in length-bounded strings: those attempts fail ``schema_invalid`` (counted) and
    are retried; guidance (the default) keeps them out. Either way every approved result parses."""
    from batch_inference.engines.structured import format_error
    from batch_inference.pipeline import Ledger, PipelineSpec, RunLayout, run_pipeline
    from batch_inference.storage import JsonlDir, JsonlFile

    src = tmp_path / "in.jsonl"
    with JsonlFile(str(src)).writer_sync() as w:
        w.write_many([{"id": f"r{i:02d}", "q": f"record {i}"} for i in range(60)])
    vllm = {"enforce_eager": True, "structured_outputs_backend": backend,
            "extra": {"enable_chunked_prefill": False, "max_num_seqs": 16}}
    spec = PipelineSpec.parse({
        "run": f"schema-{backend}", "input": str(src), "output": str(tmp_path / "out"),
        "engine": {"kind": "vllm", "model": str(tiny_model_dir), "dtype": "float32", "max_model_len": 512, "vllm": vllm},
        "infer": {"template": "Review {q} as JSON", "sampling": {"max_tokens": 200, "temperature": 1.0, "seed": 3},
                  "response_format": {"type": "json_schema", "json_schema": {"name": "review", "schema": REVIEW_SCHEMA}}},
        "judge": {"kind": "rule", "callable": "regex", "kwargs": {"pattern": "."}},
        "strategy": "rounds", "max_rounds": 3, "shard_records": 30, "pool": {"launcher": "inprocess", "concurrency": 1},
    })
    summary = await run_pipeline(spec, retries=0)
    assert summary.conservation["ok"] and summary.records == 60
    fmt = ResponseFormat("json_schema", json.dumps(REVIEW_SCHEMA, sort_keys=True))
    approved = list(JsonlDir(str(tmp_path / "out" / spec.run / "results")).iter_records_sync())
    assert approved and all(format_error(r["result"], fmt) is None and json.loads(r["result"]) for r in approved)
    infer = [r.infer for r in Ledger(RunLayout(spec.output, spec.run)).view().rounds if r.infer]
    invalid = sum(p.counts.get("schema_invalid", 0) for p in infer)
    print(f"SCHEMA {backend}: {len(approved)}/60 approved, {invalid} schema_invalid attempt(s) over {len(infer)} round(s)")
    assert (invalid > 0) if backend == "xgrammar" else (invalid == 0 and len(approved) == 60)
