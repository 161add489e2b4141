"""Embeddings end to end (issue 43 item 1): a spec with ``infer.task: embed`` runs the engine as an
embedding model, results are vectors, the Parquet export is ``fixed_size_list<float32>`` a user
loads with pyarrow and numpy, and a judge on such a spec fails at validate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batch_inference.engines import SamplingParams, build_engine
from batch_inference.pipeline import PipelineRun, PipelineSpec, SpecError, run_pipeline
from batch_inference.pipeline.parquet_export import export_parquet
from batch_inference.pipeline.preflight import preflight
from batch_inference.prompting import InferConfig, RequestBuilder, RequestError
from batch_inference.storage import JsonlDir


def embed_spec(tmp_path: Path, model: Path, **overrides: Any) -> dict[str, Any]:
    return {"run": "emb", "input": str(tmp_path / "in.jsonl"), "output": str(tmp_path / "out"),
            "engine": {"kind": "transformers", "model": str(model), "device": "cpu"},
            "infer": {"task": "embed", "template": "{text}"}, "shard_records": 10, "chunk_size": 5, **overrides}


def test_a_judge_on_an_embedding_spec_fails_at_validate(tmp_path: Path, tiny_embed_dir: Path) -> None:
    for judge in ({"kind": "rule", "callable": "regex", "kwargs": {"pattern": "."}}, {"kind": "llm", "template": "{result}"}):
        with pytest.raises(SpecError, match=r"judge: a (rule|llm) judge reads generated text.*infer.task: embed"):
            PipelineSpec.parse(embed_spec(tmp_path, tiny_embed_dir, judge=judge))
    spec = PipelineSpec.parse(embed_spec(tmp_path, tiny_embed_dir))
    assert spec.engine.task == "embed" and not spec.judged  # the engine follows infer.task


@pytest.mark.parametrize(("engine", "infer", "match"), [
    ({"task": "generate"}, {"task": "embed"}, "needs engine.task 'embed'"),
    ({"task": "embed"}, {"task": "generate"}, "only embeds"),
    ({}, {"task": "embed", "response_format": {"type": "json_object"}}, "generates none"),
    ({}, {"task": "generate", "dimensions": 8}, "dimensions is for embeddings"),
])
def test_embed_spec_rules(tmp_path: Path, tiny_embed_dir: Path, engine: dict, infer: dict, match: str) -> None:
    data = embed_spec(tmp_path, tiny_embed_dir)
    data["engine"].update(engine)
    data["infer"].update(infer)
    with pytest.raises(SpecError, match=match):
        PipelineSpec.parse(data)


def test_an_embedding_request_has_no_sampling_and_takes_the_records_dimensions() -> None:
    builder = RequestBuilder(InferConfig(task="embed", dimensions=64))
    request = builder.build({"id": "a", "prompt": "hi", "sampling": {"temperature": 1.0}}, 0)
    assert request.params == SamplingParams(embed=True, dimensions=64) and request.prompt == "hi"
    assert builder.build({"id": "b", "prompt": "hi", "dimensions": 32}, 3).params.dimensions == 32
    with pytest.raises(RequestError, match="bad_request: record 'c': dimensions 'x'"):
        builder.build({"id": "c", "prompt": "hi", "dimensions": "x"}, 0)


async def test_an_embedding_run_writes_vectors_and_exports_them_as_fixed_size_float32(tmp_path: Path, tiny_embed_dir: Path) -> None:
    texts = [f"sentence {i} about the quick brown fox" for i in range(23)] + ["sentence 0 about the quick brown fox", ""]
    (tmp_path / "in.jsonl").write_bytes(b"".join(orjson.dumps({"id": f"r{i}", "text": t}) + b"\n" for i, t in enumerate(texts)))
    spec = PipelineSpec.parse(embed_spec(tmp_path, tiny_embed_dir))
    plan = preflight(spec)
    assert plan.prompt.endswith("one vector a record (infer.task: embed)") and any(line.startswith("judge      none") for line in plan.lines())
    summary = await run_pipeline(spec)
    assert summary.records == 25 and summary.conservation["ok"]
    run = PipelineRun(spec)
    rows = {r["id"]: r for r in JsonlDir(run.layout.results).iter_records_sync()}
    assert len(rows) == 24  # the empty prompt failed alone (empty_prompt)
    engine = build_engine(spec.engine)
    want = engine.generate(engine.encode(texts[:-1]), SamplingParams(embed=True))
    for i, c in enumerate(want):
        row = rows[f"r{i}"]
        assert row["usage"] == {"prompt_tokens": c.prompt_tokens, "completion_tokens": 0}
        assert np.allclose(row["result"], c.embedding, atol=1e-6)  # the JSONL results hold the engine's own vector

    table = pq.read_table(export_parquet(run).out_url)
    result = table["run"].combine_chunks().field("result")
    assert result.type == pa.list_(pa.float32(), 128)
    ok = result.filter(result.is_valid())
    matrix = ok.flatten().to_numpy().reshape(len(ok), -1)  # what a user does: one (n, 128) float32 matrix
    assert matrix.shape == (24, 128) and matrix.dtype == np.float32
    assert np.allclose(np.linalg.norm(matrix, axis=1), 1.0, atol=1e-5)
    assert np.allclose(matrix[0], np.asarray(want[0].embedding, dtype=np.float32))
    assert table["id"].to_pylist()[-1] == "r24" and not result[24].is_valid  # the failed row: a null vector, in input order


@pytest.mark.slow
def test_the_embed_demo_runs_in_one_command_and_exports_vectors(tmp_path: Path) -> None:
    """The README's one command: ``batch-inference demo --embed`` through the Dagster definitions."""
    from click.testing import CliRunner

    from batch_inference.cli.demo_cmds import demo

    result = CliRunner().invoke(demo, ["--embed", "--dir", str(tmp_path / "d"), "--records", "40", "--ephemeral", "--run-name", "e"])
    assert result.exit_code == 0, result.output
    table = pq.read_table(tmp_path / "d" / "runs" / "e" / "export" / "parquet")
    result_column = table["run"].combine_chunks().field("result")
    assert result_column.type == pa.list_(pa.float32(), 128) and result_column.null_count == 0 and table.num_rows == 40
