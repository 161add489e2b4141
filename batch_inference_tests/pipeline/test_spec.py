"""Spec validation: every bad key is named; secrets never leave the spec object."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from batch_inference.pipeline import PipelineSpec, RunLayout, SpecError
from batch_inference_tests.pipeline.helpers import spec_dict


def test_yaml_and_toml_load_the_same_spec(tmp_path: Path) -> None:
    data = spec_dict(tmp_path)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(data))
    toml = f"""
run = "test-run"
input = "{data['input']}"
output = "{data['output']}"
strategy = "hybrid"
[engine]
kind = "simulated"
[infer]
template = "Answer: {{prompt}}"
[judge]
kind = "llm"
template = "Judge: {{result}}"
[pool]
concurrency = 3
"""
    (tmp_path / "s.toml").write_text(toml)
    from_yaml = PipelineSpec.load(tmp_path / "s.yaml")
    from_toml = PipelineSpec.load(tmp_path / "s.toml", strategy=None)
    assert from_yaml.shard_records == 100 and from_yaml.pool.concurrency == 4
    assert from_toml.strategy == "hybrid" and from_toml.pool.concurrency == 3
    assert from_toml.shard_records == 20_000 and from_toml.chunk_size == 2_000  # the reference's defaults
    assert PipelineSpec.load(tmp_path / "s.yaml", strategy="in_place").strategy == "in_place"


def test_errors_name_every_bad_key(tmp_path: Path) -> None:
    data = spec_dict(tmp_path, pool={"replcas": 2, "concurrency": "many"}, max_rounds=0)
    data["infer"]["sampling"]["sed"] = 1
    del data["output"]
    with pytest.raises(SpecError) as err:
        PipelineSpec.parse(data, source="spec.yaml")
    msg = str(err.value)
    assert "spec.yaml" in msg
    assert "pool.replcas: unknown key" in msg
    assert "infer.sampling.sed: unknown key" in msg
    assert "pool.concurrency:" in msg and "'many'" in msg
    assert "max_rounds:" in msg
    assert "output: missing required key" in msg


def test_missing_model_path_is_named(tmp_path: Path) -> None:
    data = spec_dict(tmp_path, engine={"kind": "transformers", "model": str(tmp_path / "no-model")})
    with pytest.raises(SpecError, match=r"engine.model: model directory .*no-model.* does not exist"):
        PipelineSpec.parse(data)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read spec"):
        PipelineSpec.load(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("run: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        PipelineSpec.load(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(SpecError, match="must be a mapping"):
        PipelineSpec.load(tmp_path / "list.yaml")
    (tmp_path / "spec.ini").write_text("x")
    with pytest.raises(SpecError, match="unknown spec format"):
        PipelineSpec.load(tmp_path / "spec.ini")


def test_bad_run_name_rejected(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="run:"):
        PipelineSpec.parse(spec_dict(tmp_path, run="../escape"))


def test_secrets_are_redacted(tmp_path: Path) -> None:
    spec = PipelineSpec.parse(spec_dict(tmp_path, storage_options={"key": "AKIA-SECRET", "secret": "s3cr3t"}))
    assert spec.storage_options["secret"] == "s3cr3t"
    public = spec.public_dict()
    assert public["storage_options"] == {"key": "***", "secret": "***"}
    assert "s3cr3t" not in repr(spec) and "s3cr3t" not in str(public)


def test_layout_separates_runs(tmp_path: Path) -> None:
    a, b = RunLayout(str(tmp_path), "a"), RunLayout(str(tmp_path), "b")
    urls_a = {a.sharded, a.pending(1), a.inferred(0), a.rejected(0), a.results, a.tail, a.ledger, a.exhausted}
    urls_b = {b.sharded, b.pending(1), b.inferred(0), b.rejected(0), b.results, b.tail, b.ledger, b.exhausted}
    assert not urls_a & urls_b
    assert a.pending(0) == a.sharded and a.pending(2).endswith("/a/round-02/pending")
    assert a.approved_shard(1, 3).endswith("/a/results/round-01-part-00003.jsonl.zst")
    with pytest.raises(ValueError):
        RunLayout(str(tmp_path), "x/y")


def test_structured_output_is_refused_on_an_engine_that_cannot_constrain(tmp_path) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    base = {"run": "r", "input": "in.jsonl", "output": str(tmp_path), "engine": {"kind": "simulated"},
            "judge": {"kind": "rule", "callable": "json_valid"}}
    with pytest.raises(SpecError, match="infer.response_format: engine kind 'simulated' cannot constrain generation"):
        PipelineSpec.parse({**base, "infer": {"template": "{q}", "response_format": fmt}})
    with pytest.raises(SpecError, match="judge.parse: engine kind 'simulated' cannot constrain"):
        PipelineSpec.parse({**base, "infer": {"template": "{q}"}, "judge": {"kind": "llm", "template": "{result}", "parse": "json"}})
    spec = PipelineSpec.parse({**base, "infer": {"template": "{q}", "response_format": {"type": "text"}}})
    assert not spec.infer.constrained


# -- a judge of its own: judge.engine / judge.pool -------------------------------------


def judge_engine_spec(tmp_path: Path, judge: dict | None = None, **overrides) -> dict:
    own = {"engine": {"kind": "simulated", "seed": 1, "simulated": {"approval_rate": 1.0}}}
    return spec_dict(tmp_path, judge={**own, **(judge or {})}, **overrides)


def test_a_judge_engine_gets_a_pool_of_its_own_over_the_infer_pools_settings(tmp_path: Path) -> None:
    spec = PipelineSpec.parse(judge_engine_spec(tmp_path, {"pool": {"replicas": 3, "idle_ttl_s": None}},
                                                pool={"launcher": "local", "name": "gpu", "concurrency": 6}))
    pool = spec.judge_pool
    assert pool is not None and (pool.launcher, pool.concurrency, pool.replicas) == ("local", 6, 3)
    assert pool.name == "gpu-judge" and pool.idle_ttl_s is None and spec.pool.idle_ttl_s == 600.0
    assert spec.judge_engine.simulated.approval_rate == 1.0 and spec.engine.simulated.approval_rate == 0.5
    # tasks carry the judge without its placement; the ledger's copy parses back to the same spec
    assert set(spec.judge.task_config().model_dump()) == set(spec.judge.model_dump()) - {"engine", "pool"}
    again = PipelineSpec.parse(spec.public_dict())
    assert again.judge_pool == pool and again.judge.pool.model_fields_set == {"replicas", "idle_ttl_s"}
    assert spec.placement("judge") == {"pool": "gpu-judge", "model": "simulated:seed1", "adapter": None}
    assert spec.placement("tail") == {"pool": "gpu", "model": "simulated", "adapter": None,
                                      "judge_pool": "gpu-judge", "judge_model": "simulated:seed1", "judge_adapter": None}


def test_without_a_judge_engine_the_judge_runs_on_the_infer_engine_and_pool(tmp_path: Path) -> None:
    spec = PipelineSpec.parse(spec_dict(tmp_path))
    assert spec.judge_pool is None and spec.judge_engine is spec.engine
    assert spec.placement("judge") == spec.placement("infer") == {"pool": "default", "model": "simulated", "adapter": None}


@pytest.mark.parametrize(("judge", "overrides", "message"), [
    ({"pool": {"replcas": 2}}, {}, "judge.pool.replcas: unknown key"),
    ({"engine": {"kind": "transformers", "model": "/no/such/model"}}, {}, r"judge.engine.model: model directory '/no/such/model' does not exist"),
    ({"engine": {"kind": "simulated", "simulated": {"approval": 1}}}, {}, "judge.engine.simulated.approval: unknown key"),
    ({"kind": "rule", "callable": "regex", "template": None}, {}, "judge.engine: a rule judge runs no model"),
    ({"engine": None, "pool": {"replicas": 2}}, {}, "judge.pool: a judge pool needs judge.engine"),
    ({"pool": {"launcher": "k8s"}}, {}, "judge.pool: launcher 'k8s' needs 'token_env'"),
    ({"parse": "json"}, {}, "judge.parse: judge.engine kind 'simulated' cannot constrain"),
    ({}, {"pool": {"endpoints": ["http://127.0.0.1:9"]}}, "judge.pool.endpoints: the infer pool is given by endpoints"),
    ({"pool": {"launcher": "inprocess"}}, {"pool": {"launcher": "local"}, "strategy": "hybrid"}, "judge.pool.launcher: the in-place tail judges from the infer pool's workers"),
])
def test_a_bad_judge_placement_names_its_key(tmp_path: Path, judge: dict, overrides: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        PipelineSpec.parse(judge_engine_spec(tmp_path, judge, **overrides))
