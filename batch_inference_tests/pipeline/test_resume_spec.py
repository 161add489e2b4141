"""A run resumes only under the spec it started with, for the keys that decide its results."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from batch_inference.cli.main import cli
from batch_inference.pipeline import PipelineRun, PipelineSpec, RunLayout, run_pipeline
from batch_inference.pipeline.spec import SpecChanged, result_changes
from batch_inference.storage import JsonlDir
from batch_inference_tests.pipeline.helpers import spec_dict, write_input


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


async def _stopped_in_the_layout_pass(spec, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the shard step until it has resharded and is inside the layout pass, and stop it
    there (a killed driver leaves the same ledger: ``shard-input``, no ``shard``)."""
    def killed(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt("killed in the layout pass")

    with monkeypatch.context() as m:
        m.setattr("batch_inference.pipeline.placement.layout_by_prefix", killed)
        with pytest.raises(KeyboardInterrupt):
            await PipelineRun(spec).shard()


def _prompts(spec) -> list[str]:
    return [r["prompt"] for r in JsonlDir(RunLayout(spec.output, spec.run).sharded).iter_records_sync()]


async def test_a_shard_step_stopped_in_the_layout_pass_refuses_another_input(tmp_path: Path, make_spec,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    first = make_spec(records=50)
    await _stopped_in_the_layout_pass(first, monkeypatch)
    ledger = Path(RunLayout(first.output, first.run).ledger)
    assert (ledger / "shard-input.json").exists() and not (ledger / "shard.json").exists()
    other = write_input(tmp_path / "other.jsonl", 30)
    edited = make_spec(records=50, input=str(other))
    with pytest.raises(SpecChanged, match=r"input changed"):  # the spec is compared before anything is written
        await PipelineRun(edited).shard()
    assert orjson.loads((ledger / "spec.json").read_bytes())["input"] == first.input  # the spec the run started with
    shard = await PipelineRun(first).shard()  # the spec it started with resumes
    assert shard.records == 50


async def test_a_resharded_input_is_reused_only_under_the_keys_it_was_made_from(tmp_path: Path, make_spec,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    first = make_spec(records=50)
    await _stopped_in_the_layout_pass(first, monkeypatch)
    # a ledger without the recorded spec (an older run's): the shard-input entry's own fingerprint decides
    (Path(RunLayout(first.output, first.run).ledger) / "spec.json").unlink()
    other = write_input(tmp_path / "other.jsonl", 30)
    edited = make_spec(records=50, input=str(other))
    shard = await PipelineRun(edited).shard()
    assert shard.records == 30 and len(_prompts(edited)) == 30  # the new input's records, not the old ones
    # a key that decides no result (shard_records) but made the entry: resharded too, and resumed without a complaint
    smaller = make_spec(records=50, input=str(other), shard_records=10, run="smaller")
    await _stopped_in_the_layout_pass(smaller, monkeypatch)
    resumed = await PipelineRun(make_spec(records=50, input=str(other), shard_records=7, run="smaller")).shard()
    assert resumed.records == 30 and resumed.shards == len(JsonlDir(RunLayout(smaller.output, "smaller").sharded).shards())


async def test_a_start_that_left_nothing_to_resume_starts_over_under_the_edited_spec(tmp_path: Path, make_spec) -> None:
    missing = make_spec(records=50, input=str(tmp_path / "nope.jsonl"))
    with pytest.raises(Exception, match="nope.jsonl"):
        await PipelineRun(missing).shard()
    fixed = make_spec(records=50)
    assert (await PipelineRun(fixed).shard()).records == 50



def _adapter_folder(path: Path, weights: bytes) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_model.safetensors").write_bytes(weights)
    return str(path)


def _lora_spec(tmp_path: Path, adapters: dict[str, str], *, engine: dict | None = None, **overrides):
    """A run whose records go to adapter ``concise`` of the simulated engine (which salts its outputs by the name)."""
    data = spec_dict(tmp_path, records=60, infer={"adapter": "concise"}, **overrides)
    data["engine"] = {**data["engine"], **(engine or {})}
    data["engine"]["simulated"] = {**data["engine"]["simulated"], "lora": {"adapters": adapters}}
    return PipelineSpec.parse(data)


async def test_a_resumed_run_refuses_an_adapter_or_max_model_len_that_changed_its_results(tmp_path: Path) -> None:
    v1 = _adapter_folder(tmp_path / "concise-v1", b"weights 1")
    first = await run_pipeline(_lora_spec(tmp_path, {"concise": v1}))
    assert first.approved > 0
    v2 = _adapter_folder(tmp_path / "concise-v2", b"weights 2")
    with pytest.raises(SpecChanged, match=r"engine\.simulated\.lora\.adapters\.concise changed"):
        await run_pipeline(_lora_spec(tmp_path, {"concise": v2}))  # pointed at other weights
    with pytest.raises(SpecChanged, match=r"engine\.max_model_len changed"):  # decides which records fail prompt_too_long
        await run_pipeline(_lora_spec(tmp_path, {"concise": v1}, engine={"max_model_len": 64}))
    _adapter_folder(tmp_path / "concise-v1", b"weights 1, retrained")
    with pytest.raises(SpecChanged, match=r"engine\.simulated\.lora\.adapters\.concise \(its files\) changed"):
        await run_pipeline(_lora_spec(tmp_path, {"concise": v1}))  # retrained in place


def test_the_judge_engines_adapters_and_model_folder_count_too(tmp_path: Path) -> None:
    judge = {"kind": "llm", "template": "Grade: {result}", "adapter": "strict",
             "engine": {"kind": "simulated", "simulated": {"lora": {"adapters": {"strict": "/adapters/strict-v1"}}}}}
    before = PipelineSpec.parse(spec_dict(tmp_path, judge=judge)).public_dict()
    judge["engine"]["simulated"]["lora"]["adapters"]["strict"] = "/adapters/strict-v2"
    assert result_changes(before, PipelineSpec.parse(spec_dict(tmp_path, judge=judge)).public_dict()) == [
        "judge.engine.simulated.lora.adapters.strict"]
    model = str(tmp_path / "model")  # a model folder retrained under the same path: its files' fingerprint differs
    spec = {**before, "engine": {**before["engine"], "model": model}}
    assert result_changes(spec, spec, folders=({model: "a1"}, {model: "b2"})) == ["engine.model (its files)"]
    assert result_changes(spec, spec, folders=({}, {model: "b2"})) == []  # no fingerprint then: the path decides
    # a ledger's fingerprint from before whole-file hashing is not comparable to today's: the path decides
    assert result_changes(spec, spec, folders=({model: "a1"}, {model: "sha256:b2"})) == []
    assert result_changes(spec, spec, folders=({model: "sha256:a1"}, {model: "sha256:b2"})) == ["engine.model (its files)"]


async def test_an_unused_adapter_added_to_the_engine_resumes_and_the_recorded_spec_is_the_one_written(tmp_path: Path) -> None:
    v1 = _adapter_folder(tmp_path / "concise-v1", b"weights 1")
    spec = _lora_spec(tmp_path, {"concise": v1})
    first = await run_pipeline(spec)
    recorded = orjson.loads((Path(RunLayout(spec.output, spec.run).ledger) / "spec.json").read_bytes())
    assert recorded["infer"]["adapters"] == []  # as written: the validators filled nothing in
    assert spec.request_infer.adapters == ("concise",)  # what tasks carry: the engine's adapters
    verbose = _adapter_folder(tmp_path / "verbose", b"other weights")
    again = await run_pipeline(_lora_spec(tmp_path, {"concise": v1, "verbose": verbose}))
    assert (again.status, again.approved) == (first.status, first.approved)


def test_a_folders_fingerprint_is_its_content_not_where_or_when_it_was_copied(tmp_path: Path) -> None:
    import os
    import shutil

    from batch_inference.speckeys import folder_digest

    big = os.urandom(3 << 20)
    weights = _adapter_folder(tmp_path / "a", big)
    (tmp_path / "a" / "adapter_config.json").write_text('{"r": 8}')
    copy = tmp_path / "pod" / "a"
    shutil.copytree(weights, copy, copy_function=shutil.copyfile)  # new mtimes, as a model copied into a pod
    os.utime(copy / "adapter_config.json", (1, 1))
    assert folder_digest(weights) == folder_digest(str(copy)) is not None
    (copy / "adapter_model.safetensors").write_bytes(big[:-1] + bytes([big[-1] ^ 1]))  # retrained: same size
    assert folder_digest(str(copy)) != folder_digest(weights)
    middle = len(big) // 2  # a same-size edit in the middle (one layer fine-tuned): hashed whole, seen
    (copy / "adapter_model.safetensors").write_bytes(big[:middle] + bytes([big[middle] ^ 1]) + big[middle + 1:])
    assert folder_digest(str(copy)) != folder_digest(weights)
    assert folder_digest(str(tmp_path / "absent")) is None and folder_digest("s3://bucket/a") is None
