"""A result that claims a response format satisfies it: a constrained completion that is
not strict JSON (a raw control character in a string) or not valid against its schema fails
the attempt as ``schema_invalid`` (retryable, counted in the ledger) and is never judged."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from batch_inference.engines import Completion, SamplingParams, SimulatedOptions
from batch_inference.engines import config as engine_config
from batch_inference.engines.base import Tokens
from batch_inference.engines.chat import prompt_text
from batch_inference.engines.simulated import LinearSimulatedEngine
from batch_inference.pipeline import Ledger, PipelineSpec, RunLayout, run_pipeline
from batch_inference.pool import engine_host as engine_host_module
from batch_inference.storage import JsonlDir

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["label", "score", "tags"],
          "properties": {"label": {"enum": ["good", "bad"]}, "score": {"type": "integer", "minimum": 1, "maximum": 5},
                         "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 8}}}}
VALID = '{"label": "good", "score": 3, "tags": ["a", "b"]}'
# What a grammar backend let through, by the word in the prompt, on a record's first FAILS[word] calls.
INVALID = {"control": '{"label": "good", "score": 3, "tags": ["a\x01b"]}',  # raw U+0001: json.loads refuses it
           "range": '{"label": "good", "score": 9, "tags": []}',  # parses, but 9 > maximum 5
           "always": '{"label": "maybe", "score": 3, "tags": []}'}  # not in the enum, on every attempt
FAILS = {"control": 1, "range": 2, "always": 1_000}


class LooseGrammarEngine(LinearSimulatedEngine):
    """A simulated engine that says it constrains output and answers JSON, invalid as ``INVALID`` says."""

    structured_output = True

    def __init__(self) -> None:
        super().__init__(SimulatedOptions(latency_a_s=0.0, latency_b_s=0.0))
        self.seen: Counter[str] = Counter()

    def generate(self, prompts: list[Any], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        out = []
        for prompt, c in zip(prompts, super().generate(prompts, params)):
            prompt = prompt_text(prompt.source if isinstance(prompt, Tokens) else prompt)
            word = next((w for w in INVALID if w in prompt), None)
            self.seen[prompt] += 1
            text = INVALID[word] if word and self.seen[prompt] <= FAILS[word] else VALID
            out.append(Completion(text, c.prompt_tokens, 12, "stop"))
        return out


@pytest.fixture
def loose_engine(monkeypatch: pytest.MonkeyPatch) -> LooseGrammarEngine:
    engine = LooseGrammarEngine()
    monkeypatch.setattr(engine_host_module, "build_engine", lambda cfg: engine)
    # the spec names the simulated kind; the engine standing in for it constrains output
    monkeypatch.setattr(engine_config, "STRUCTURED_OUTPUT_KINDS", engine_config.STRUCTURED_OUTPUT_KINDS | {"simulated"})
    return engine


@pytest.mark.parametrize("strategy", ["rounds", "in_place"])
async def test_results_that_fail_their_schema_are_retried_never_approved(tmp_path: Path, strategy: str, loose_engine) -> None:
    src = tmp_path / "input.jsonl"
    words = ["control", "range", "always"] + ["plain"] * 9
    src.write_bytes(b"".join(orjson.dumps({"id": f"{w}-{i}", "prompt": f"{w} question {i}"}) + b"\n" for i, w in enumerate(words)))
    spec = PipelineSpec.parse({
        "run": f"schema-{strategy}", "input": str(src), "output": str(tmp_path / "out"), "engine": {"kind": "simulated"},
        "infer": {"template": "{prompt}", "sampling": {"max_tokens": 64, "seed": 7},
                  "response_format": {"type": "json_schema", "json_schema": {"name": "review", "schema": SCHEMA}}},
        "judge": {"kind": "rule", "callable": "regex", "kwargs": {"pattern": "."}},  # approves any text
        "strategy": strategy, "max_rounds": 4, "max_attempts": 4, "shard_records": 6, "chunk_size": 6,
        "pool": {"launcher": "inprocess", "concurrency": 2, "batcher": {"batch_timeout_s": 0.002}},
    })
    summary = await run_pipeline(spec, retries=0)
    assert summary.conservation["ok"] and summary.records == 12
    root = tmp_path / "out" / spec.run
    approved = {r["id"]: r for r in JsonlDir(str(root / "results")).iter_records_sync()}
    assert all(json.loads(r["result"]) == json.loads(VALID) for r in approved.values())  # each approved result parses
    assert approved["control-0"]["attempts"] == 2 and approved["range-1"]["attempts"] == 3
    assert "always-2" not in approved and summary.approved == 11
    (always,) = [r for d in ("exhausted", "tail/unfinished") if (root / d).exists()
                 for r in JsonlDir(str(root / d)).iter_records_sync() if r["id"] == "always-2"]
    assert always["status"] == ("exhausted" if strategy == "rounds" else "max_attempts") and always["attempts"] == 4
    view = Ledger(RunLayout(spec.output, spec.run)).view()
    phases = [r.infer for r in view.rounds] + [view.tail]
    counted = sum(p.counts.get("schema_invalid", 0) for p in phases if p is not None)
    assert counted == 1 + 2 + 4  # control once, range twice, always on each of its 4 attempts
    if strategy == "in_place":
        assert always["last_error"].startswith("schema_invalid: at $.label: 'maybe' is not one of"), always
