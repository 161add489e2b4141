"""Chat, per-record sampling and response formats through the shard tasks (InProcessPool)."""

from __future__ import annotations

from pathlib import Path

from batch_inference.pool import InferConfig, SamplingConfig
from batch_inference_tests.fixtures.pool import SIM_ENGINE, infer_spec, read_rows
from batch_inference.storage import JsonlFile


def _write(path: Path, records: list[dict]) -> None:
    with JsonlFile(str(path)).writer_sync() as w:
        w.write_many(records)


async def test_chat_records_through_the_tiny_model(tmp_path: Path, tiny_model_dir: Path, inprocess_pool) -> None:
    from transformers import AutoTokenizer

    records = [
        {"id": "c1", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
        {"id": "c2", "messages": [{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}],
         "sampling": {"max_tokens": 3, "min_tokens": 3}},
        {"id": "bad-role", "messages": [{"role": "wizard", "content": "x"}]},
        {"id": "no-messages", "question": "?"},
        {"id": "greedy-cap", "messages": [{"role": "user", "content": "x"}], "sampling": {"max_tokens": 999}},
    ]
    _write(tmp_path / "in.jsonl", records)
    infer = InferConfig(system="You answer briefly.", sampling=SamplingConfig(max_tokens=4, min_tokens=4), limits={"max_tokens": 8})
    engine = {"kind": "transformers", "model": str(tiny_model_dir), "device": "cpu"}
    async with inprocess_pool(engine) as pool:
        result = await pool.run_task(infer_spec("chat", tmp_path / "in.jsonl", tmp_path / "out.jsonl", infer=infer))
    rows = {r["id"]: r for r in read_rows(tmp_path / "out.jsonl")}
    assert result.counts == {"ok": 2, "error": 3} and len(rows) == 5
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    want = tok.apply_chat_template([{"role": "system", "content": "You answer briefly."}, *records[0]["messages"]],
                                   add_generation_prompt=True, tokenize=True)["input_ids"]
    assert rows["c1"]["usage"] == {"prompt_tokens": len(want), "completion_tokens": 4}
    assert rows["c2"]["usage"]["completion_tokens"] == 3  # the record's own max_tokens
    assert rows["bad-role"]["error"].startswith("bad_messages: record 'bad-role': messages[0].role 'wizard'")
    assert rows["no-messages"]["error"].startswith("bad_request: record 'no-messages'")
    assert rows["greedy-cap"]["error"].startswith("bad_sampling: record 'greedy-cap': sampling.max_tokens is 999")


async def test_constrained_request_is_never_run_unconstrained(tmp_path: Path, inprocess_pool) -> None:
    _write(tmp_path / "in.jsonl", [{"id": "j", "prompt": "give json", "response_format": {"type": "json_object"}},
                                   {"id": "t", "prompt": "free text"}])
    async with inprocess_pool(SIM_ENGINE) as pool:
        result = await pool.run_task(infer_spec("fmt", tmp_path / "in.jsonl", tmp_path / "out.jsonl", infer=InferConfig()))
    rows = {r["id"]: r for r in read_rows(tmp_path / "out.jsonl")}
    assert result.counts == {"ok": 1, "error": 1}
    assert rows["j"]["error"].startswith("unsupported_response_format: engine simulated") and rows["j"]["result"] is None
    assert rows["t"]["error"] is None


class _ConstrainingHost:
    """A host whose engine says it constrains; every completion is cut at max_tokens."""

    engine = type("E", (), {"structured_output": True, "name": "fake"})()
    streaming = False

    async def encode(self, prompts):
        from batch_inference.engines import Tokens

        return [Tokens([1, 2, 3], p) for p in prompts]

    async def submit(self, requests, *, together=False):
        import asyncio

        from batch_inference.engines import Completion

        loop = asyncio.get_running_loop()
        futures = []
        for r in requests:
            f = loop.create_future()
            f.set_result(Completion('{"a": ', 3, r.params.max_tokens, "length"))
            futures.append(f)
        return futures


async def test_constrained_output_cut_by_max_tokens_is_an_error_not_a_result(tmp_path: Path) -> None:
    from batch_inference.engines import ResponseFormat, SamplingParams
    from batch_inference.pool.context import TaskContext
    from batch_inference.prompting import Request

    ctx = TaskContext(infer_spec("t", tmp_path / "in", tmp_path / "out"), host=_ConstrainingHost())  # type: ignore[arg-type]
    cut, free = await ctx.generate([Request("x", SamplingParams(max_tokens=5, response_format=ResponseFormat("json_object"))),
                                    Request("y", SamplingParams(max_tokens=5))])
    assert cut.error == "truncated_output: max_tokens 5 reached before the constrained output was complete"
    assert free.error is None and free.finish_reason == "length"


async def test_chat_judge_through_the_tiny_models_chat_template(tmp_path: Path, tiny_model_dir: Path, inprocess_pool) -> None:
    """A chat LLM judge's prompt is one user turn (plus its system turn) rendered by the chat template."""
    from batch_inference.judges import JudgeConfig
    from batch_inference.pool import TaskSpec

    _write(tmp_path / "inf.jsonl", [{"id": f"a{i}", "q": "2+2?", "result": "4", "error": None} for i in range(3)])
    judge = JudgeConfig(kind="llm", template="Q: {q} A: {result}. APPROVED or REJECTED?", chat=True, system="strict", max_tokens=2)
    engine = {"kind": "transformers", "model": str(tiny_model_dir), "device": "cpu"}
    spec = TaskSpec(task_id="j", kind="judge", input_url=str(tmp_path / "inf.jsonl"), judge=judge,
                    outputs={"approved": str(tmp_path / "ok.jsonl"), "rejected": str(tmp_path / "no.jsonl")})
    async with inprocess_pool(engine) as pool:
        result = await pool.run_task(spec)
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(tiny_model_dir).apply_chat_template(
        [{"role": "system", "content": "strict"}, {"role": "user", "content": "Q: 2+2? A: 4. APPROVED or REJECTED?"}],
        add_generation_prompt=True, tokenize=True)["input_ids"]
    assert result.records_in == 3 and result.tokens_in == 3 * len(want)  # exactly the template's tokens
    rows = read_rows(tmp_path / "ok.jsonl") + read_rows(tmp_path / "no.jsonl")
    assert len(rows) == 3 and all(r["verdict"] is not None for r in rows)  # random weights: a verdict or unparseable
