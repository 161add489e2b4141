"""A record's walk from input line to engine: one tokenisation and one sampling conversion per attempt.

The shard task encodes each prompt once (``EngineHost.encode``) and hands the ids to the
engine, which runs them as they are: costing a request for the batcher and running it
share that one tokenisation. Counted on the tokenizers themselves, through an infer task
(one attempt) and an in-place retry task whose judge rejects everything (two attempts).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from batch_inference.engines import SamplingParams
from batch_inference.engines.chat import TokenizerCopy
from batch_inference.judges import JudgeConfig
from batch_inference.pool import InferConfig, SamplingConfig, TaskSpec
from batch_inference.storage import JsonlFile
from batch_inference_tests.fixtures.pool import SIM_ENGINE, read_rows

N = 6
NEVER = JudgeConfig(kind="rule", callable="regex", kwargs={"pattern": "^never matches$"})


def records() -> list[dict[str, Any]]:
    """Text and chat prompts, half with their own sampling (the per-record override path)."""
    out: list[dict[str, Any]] = []
    for i in range(N):
        rec: dict[str, Any] = {"id": f"r{i}"}
        if i % 2:
            rec["messages"] = [{"role": "user", "content": f"question {i}?"}]
        else:
            rec["prompt"] = f"question {i} in plain text"
        if i % 3 == 0:
            rec["sampling"] = {"max_tokens": 3, "temperature": 0.5, "seed": i}
        out.append(rec)
    return out


def tasks(tmp_path: Path) -> list[tuple[TaskSpec, int]]:
    """(task, attempts each record makes): an infer task, then an in-place retry of two attempts."""
    src = tmp_path / "in.jsonl"
    with JsonlFile(str(src)).writer_sync() as w:
        w.write_many(records())
    infer = InferConfig(sampling=SamplingConfig(max_tokens=4, temperature=1.0, seed=1))
    return [
        (TaskSpec(task_id="infer", kind="infer", input_url=str(src), infer=infer, outputs={"output": str(tmp_path / "a.jsonl")}), 1),
        (TaskSpec(task_id="retry", kind="retry", input_url=str(src), infer=infer, judge=NEVER, max_attempts=2,
                  outputs={"output": str(tmp_path / "b.jsonl"), "checkpoint": str(tmp_path / "ckpt")}), 2),
    ]


class CountingTokenizer:
    """A tokenizer proxy that counts the prompts it encodes (each text of a batched call, each
    chat template rendered to tokens, each ``encode``); padding and decoding are not tokenisation."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.prompts = 0

    def __call__(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        self.prompts += len(text) if isinstance(text, list) else 1
        return self._inner(text, *args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("tokenize", True):  # rendered to text only, its tokens come from a call
            self.prompts += 1
        return self._inner.apply_chat_template(*args, **kwargs)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.prompts += 1
        return self._inner.encode(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def count_engine_tokenizers(engine: Any) -> list[CountingTokenizer]:
    """Put a counter on every tokenizer the engine holds (its own and its encoding copy)."""
    counters = [CountingTokenizer(engine.tokenizer)]
    engine.tokenizer = counters[0]
    for value in vars(engine).values():
        if isinstance(value, TokenizerCopy):
            counters.append(CountingTokenizer(value.tokenizer))
            value.tokenizer = counters[-1]
    return counters


async def test_transformers_engine_tokenises_each_record_once_per_attempt(tmp_path: Path, tiny_model_dir: Path, inprocess_pool) -> None:
    engine = {"kind": "transformers", "model": str(tiny_model_dir), "device": "cpu"}
    async with inprocess_pool(engine) as pool:
        counters = count_engine_tokenizers(pool.host.engine)
        for spec, attempts in tasks(tmp_path):
            before = sum(c.prompts for c in counters)
            result = await pool.run_task(spec)
            assert result.records_in == N
            assert sum(c.prompts for c in counters) - before == N * attempts, spec.task_id
    rows = read_rows(tmp_path / "b.jsonl")
    assert len(rows) == N and all(r["status"] == "max_attempts" and r["attempts"] == 2 for r in rows)
    assert all(r["error"] is None and r["usage"]["prompt_tokens"] > 0 for r in read_rows(tmp_path / "a.jsonl"))


@dataclass
class Conversions:
    """SamplingParams built (``__post_init__`` runs once per construction or ``replace``)."""

    n: int = 0


@pytest.mark.parametrize("scheduling", ["blocking", "continuous"])
async def test_simulated_engine_tokenises_each_record_once_and_converts_its_sampling_once(
    tmp_path: Path, inprocess_pool, monkeypatch: pytest.MonkeyPatch, scheduling: str
) -> None:
    from batch_inference.engines import simulated

    tokenised = Conversions()
    real_count = simulated.simulated_token_count

    def counting(text: str) -> int:
        tokenised.n += 1
        return real_count(text)

    monkeypatch.setattr(simulated, "simulated_token_count", counting)
    built = Conversions()
    real_post_init = SamplingParams.__post_init__

    def post_init(self: SamplingParams) -> None:
        built.n += 1
        real_post_init(self)

    monkeypatch.setattr(SamplingParams, "__post_init__", post_init)
    engine = SIM_ENGINE if scheduling == "blocking" else {
        "kind": "simulated", "simulated": {"cost_model": "decode", "scheduling": "continuous", "output_tokens": 2}}
    async with inprocess_pool(engine) as pool:
        for spec, attempts in tasks(tmp_path):
            tokenised.n = built.n = 0
            result = await pool.run_task(spec)
            assert result.records_in == N
            assert tokenised.n == N * attempts, spec.task_id
            assert built.n == 1 + N * attempts, spec.task_id  # the task's base sampling, then one per record and attempt
