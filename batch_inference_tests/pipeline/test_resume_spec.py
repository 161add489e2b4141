"""A run resumes only under the spec it started with, for the keys that decide its results."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from batch_inference.cli.main import cli
from batch_inference.pipeline import run_pipeline
from batch_inference.pipeline.spec import SpecChanged, result_changes


def test_result_changes_name_the_dotted_keys_that_decide_results() -> None:
    a = {"infer": {"template": "A {prompt}", "sampling": {"max_tokens": 8}}, "engine": {"kind": "simulated", "model": None},
         "pool": {"replicas": 1}, "judge": {"kind": "llm"}}
    b = {**a, "infer": {"template": "B {prompt}", "sampling": {"max_tokens": 8}}, "pool": {"replicas": 4},
         "engine": {"kind": "simulated", "model": None, "vllm": {"max_num_seqs": 8}}}
    assert result_changes(a, b) == ["infer.template"]  # the pool and engine tuning only say how it runs
    assert result_changes(a, {**a, "judge": {"kind": "rule"}, "engine": {"kind": "vllm", "model": "m"}}) == [
        "engine.kind", "engine.model", "judge.kind"]
    # a judge's own engine counts as the top-level one does; where the judge runs does not count
    own = {**a, "judge": {"kind": "llm", "engine": {"kind": "simulated", "seed": 1, "vllm": {}}, "pool": None}}
    placed = {**own, "judge": {**own["judge"], "pool": {"launcher": "local", "endpoints": ["http://127.0.0.1:9"]},
                               "engine": {"kind": "simulated", "seed": 1, "vllm": {"max_num_seqs": 4}}}}
    assert result_changes(own, placed) == []
    assert result_changes(own, {**own, "judge": {**own["judge"], "engine": {"kind": "simulated", "seed": 2}}}) == ["judge.engine.seed"]


async def test_a_finished_run_refuses_an_edited_template_and_resumes_an_edited_pool(make_spec) -> None:
    first = await run_pipeline(make_spec(records=200))
    assert first.approved > 0
    with pytest.raises(SpecChanged, match=r"infer\.template changed") as err:
        await run_pipeline(make_spec(records=200, infer={"template": "Say: {prompt}"}))
    assert "new `run` name" in str(err.value)
    again = await run_pipeline(make_spec(records=200, pool={"concurrency": 2}))
    assert (again.status, again.approved) == (first.status, first.approved)


async def test_a_run_stopped_mid_round_refuses_an_edited_judge(make_spec) -> None:
    from batch_inference.pipeline import PipelineRun
    from batch_inference.pipeline.runner import open_runner

    spec = make_spec(records=200)
    async with open_runner(spec) as runner:
        run = PipelineRun(spec, runner)
        await run.shard()
        await run.infer(0)
    edited = make_spec(records=200, judge={"template": "Grade: {result}"})
    async with open_runner(edited) as runner:
        with pytest.raises(SpecChanged, match=r"judge\.template changed"):
            await PipelineRun(edited, runner).judge(0)


def test_the_cli_names_the_changed_key(tmp_path, make_spec) -> None:
    import yaml

    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(make_spec(records=100, approval=1.0).model_dump(mode="json")))
    assert CliRunner().invoke(cli, ["run", str(path)]).exit_code == 0
    path.write_text(yaml.safe_dump(make_spec(records=100, approval=1.0, engine={"seed": 3}).model_dump(mode="json")))
    res = CliRunner().invoke(cli, ["run", str(path)])
    assert res.exit_code != 0 and "engine.seed changed" in res.output and "SpecChanged" in res.output
