"""One rule for retrying a record's own error, in rounds and in place: a retryable kind
(``engine_error``, ``truncated_output``) costs an attempt and is retried within
``max_attempts``; a permanent kind ends the record ``failed`` at once."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from batch_inference.engines import Completion, SamplingParams, SimulatedOptions
from batch_inference.engines.base import Tokens
from batch_inference.engines.simulated import LinearSimulatedEngine
from batch_inference.pipeline import PipelineSpec, run_pipeline
from batch_inference.pool import engine_host as engine_host_module
from batch_inference.rows import ErrorKind
from batch_inference.storage import JsonlDir


class FlakyEngine(LinearSimulatedEngine):
    """Fails a prompt's first ``FAILS[word]`` calls with ``word``'s error kind, then answers it."""

    FAILS = {"flaky": 2, "truncates": 1, "broken": 1_000}
    KINDS = {"flaky": ErrorKind.ENGINE_ERROR, "truncates": ErrorKind.TRUNCATED_OUTPUT, "broken": ErrorKind.ENGINE_ERROR}

    def __init__(self) -> None:
        super().__init__(SimulatedOptions(fail_on="POISON", latency_a_s=0.0, latency_b_s=0.0))
        self.seen: Counter[str] = Counter()

    def generate(self, prompts: list[Any], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        out = super().generate(prompts, params)
        for i, request in enumerate(prompts):
            prompt = request.source if isinstance(request, Tokens) else request  # the shard task sends encoded prompts
            word = next((w for w in self.FAILS if w in prompt), None)
            if word is not None:
                self.seen[prompt] += 1
                if self.seen[prompt] <= self.FAILS[word]:
                    out[i] = Completion.failed(self.KINDS[word].tag(f"{word} on call {self.seen[prompt]}"), prompt_tokens=3)
        return out


def _spec(tmp_path: Path, strategy: str) -> PipelineSpec:
    src = tmp_path / "input.jsonl"
    words = ["flaky", "truncates", "broken", "POISON"] + ["plain"] * 16
    src.write_bytes(b"".join(orjson.dumps({"id": f"{w}-{i}", "prompt": f"{w} question {i}"}) + b"\n" for i, w in enumerate(words)))
    return PipelineSpec.parse({
        "run": f"rule-{strategy}", "input": str(src), "output": str(tmp_path / "out"),
        "engine": {"kind": "simulated"},  # FlakyEngine stands in for it
        "infer": {"template": "{prompt}", "sampling": {"max_tokens": 8, "seed": 7}},
        "judge": {"kind": "rule", "callable": "regex", "kwargs": {"pattern": "."}},  # approves every answer
        "strategy": strategy, "max_rounds": 4, "max_attempts": 4, "shard_records": 10, "chunk_size": 10,
        "pool": {"launcher": "inprocess", "concurrency": 2, "batcher": {"batch_timeout_s": 0.002}},
    })


def _terminal(root: Path) -> dict[str, tuple[str, int]]:
    """id -> (terminal state, attempts), from every terminal set the run wrote."""
    out: dict[str, tuple[str, int]] = {}
    for sub in ("results", "exhausted", "tail/unfinished", *(f"round-{r:02d}/failed-records" for r in range(4))):
        d = JsonlDir(str(root / sub))
        if d.exists_sync():
            for row in d.iter_records_sync():
                out[row["id"]] = (row["status"], row["attempts"])
    return out


@pytest.mark.parametrize("strategy", ["rounds", "in_place"])
async def test_retryable_record_errors_are_retried_within_max_attempts_in_both_strategies(
    tmp_path: Path, strategy: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = FlakyEngine()
    monkeypatch.setattr(engine_host_module, "build_engine", lambda cfg: engine)
    spec = _spec(tmp_path, strategy)
    summary = await run_pipeline(spec, retries=0)
    assert summary.conservation["ok"] and summary.records == 20
    terminal = _terminal(tmp_path / "out" / spec.run)
    assert terminal["flaky-0"] == ("approved", 3)  # two engine_error attempts, then approved
    assert terminal["truncates-1"] == ("approved", 2)  # one truncated_output attempt
    # retryable on every attempt: retried up to the cap, never ended failed
    never = "exhausted" if strategy == "rounds" else "max_attempts"
    assert terminal["broken-2"] == (never, 4)
    assert terminal["POISON-3"][0] in ("failed", "error") and terminal["POISON-3"][1] == 1  # permanent: at once
    assert summary.failed == 1 and summary.approved == 18
