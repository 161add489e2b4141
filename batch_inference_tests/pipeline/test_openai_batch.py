"""OpenAI Batch API files in -> run -> output + error files out (the documented format)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from batch_inference.pipeline import PipelineRun, PipelineSpec, run_pipeline
from batch_inference.pipeline.export import export_openai_batch
from batch_inference.pipeline.inputs import InputError
from batch_inference.pipeline.preflight import preflight
from batch_inference.prompting.openai_batch import OpenAIBatchReader
from batch_inference.storage import JsonlDir, JsonlFile
from batch_inference_tests.pipeline.helpers import spec_dict


def chat_line(cid: str, content: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": content}], **body}}


def write_lines(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    return path


def openai_spec(tmp_path: Path, lines: list[dict[str, Any]], **overrides: Any) -> PipelineSpec:
    src = write_lines(tmp_path / "batch.jsonl", lines)
    overrides.setdefault("openai_batch", {"model": "tiny"})
    data = spec_dict(tmp_path, input=str(src), **overrides)
    data["infer"] = {"system": "be brief", "sampling": {"max_tokens": 8, "seed": 7}, "limits": {"max_tokens": 32},
                     **overrides.get("infer", {})}
    return PipelineSpec.parse(data)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path) as f:  # a plain json reader: what a user's tooling does
        return [json.loads(line) for line in f]


def check_output_line(line: dict[str, Any]) -> None:
    assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
    assert line["id"].startswith("batch_req_") and isinstance(line["custom_id"], str)
    response = line["response"]
    assert response["status_code"] == 200 and response["request_id"].startswith("req_")
    body = response["body"]
    assert body["object"] == "chat.completion" and body["model"] == "tiny" and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] and usage["prompt_tokens"] > 0


def check_error_line(line: dict[str, Any]) -> None:
    assert set(line) == {"id", "custom_id", "response", "error"} and line["response"] is None
    assert set(line["error"]) == {"code", "message"} and line["error"]["code"] and line["error"]["message"]


async def test_round_trip_every_custom_id_exactly_once(tmp_path: Path) -> None:
    lines = [chat_line(f"req-{i}", f"question {i}") for i in range(120)]
    lines += [
        chat_line("too-many-tokens", "x", max_tokens=10_000),
        chat_line("n-too-large", "x", n=3),
        {"custom_id": "no-messages", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "tiny"}},
        {**chat_line("wrong-role", "x"), "body": {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}},
        chat_line("own-sampling", "y", max_completion_tokens=4, temperature=0.5, top_p=0.9, seed=3, stop=["\n"]),
    ]
    spec = openai_spec(tmp_path, lines, max_rounds=2)
    summary = await run_pipeline(spec)
    run = PipelineRun(spec)
    assert run.ledger.read("shard")["input_format"] == "openai_batch"
    exported = export_openai_batch(run)
    out, errors = read_jsonl(exported.output_url), read_jsonl(exported.errors_url)
    ids = [x["custom_id"] for x in out] + [x["custom_id"] for x in errors]
    assert sorted(ids) == sorted(x["custom_id"] for x in lines) and len(ids) == len(set(ids)) == 125
    for line in out:
        check_output_line(line)
    for line in errors:
        check_error_line(line)
    by_id = {x["custom_id"]: x["error"] for x in errors}
    assert by_id["too-many-tokens"]["code"] == "bad_sampling" and "'too-many-tokens'" in by_id["too-many-tokens"]["message"]
    assert "limits.max_tokens 32" in by_id["too-many-tokens"]["message"]
    assert by_id["n-too-large"]["code"] == "bad_sampling" and "n is 3" in by_id["n-too-large"]["message"]
    assert by_id["no-messages"]["code"] == "bad_request" and by_id["wrong-role"]["code"] == "bad_messages"
    assert "own-sampling" not in by_id or by_id["own-sampling"]["code"] == "exhausted"
    # judge rejections left after max_rounds are errors with their reason, not lost
    exhausted = [e for e in by_id.values() if e["code"] == "exhausted"]
    assert len(exhausted) == summary.exhausted and all("last rejection" in e["message"] for e in exhausted)
    assert exported.output == summary.approved and exported.prompt_tokens == sum(
        x["response"]["body"]["usage"]["prompt_tokens"] for x in out)


async def test_detected_without_input_format(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spec = openai_spec(tmp_path, [chat_line("a", "x"), chat_line("b", "y")], input_format="auto")
    with caplog.at_level("INFO"):
        await PipelineRun(spec).shard()
    assert "OpenAI Batch input (detected" in caplog.text
    rows = sorted(JsonlDir(PipelineRun(spec).layout.sharded).iter_records_sync(), key=lambda r: r["id"])
    assert rows[0] == {"id": "a", "messages": [{"role": "user", "content": "x"}],
                       "openai": {"url": "/v1/chat/completions", "model": "tiny"}, "_input": {"row": 0}}  # its line


async def test_file_level_problems_are_one_error_before_the_run(tmp_path: Path) -> None:
    lines = [
        chat_line("dup", "x"), chat_line("dup", "y"),
        chat_line("tools", "x", tools=[{"type": "function"}], logprobs=True),
        chat_line("other-model", "x") | {"body": {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}},
        {"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": {"model": "tiny", "input": "x"}},
        chat_line("schema", "x", response_format={"type": "json_object"}),
    ]
    spec = openai_spec(tmp_path, lines, input_format="openai_batch")
    with pytest.raises(InputError) as info:
        await PipelineRun(spec).shard()
    text = str(info.value)
    for needle in ("logprobs: true: log probabilities are not returned", "unsupported body field 'tools'", "custom_id 'tools'",
                   "body.model 'gpt-4o' is not served by this run (accepted: tiny)", "openai_batch.model_aliases",
                   "openai_batch.check_model: false", "url '/v1/embeddings'",
                   "duplicate custom_id", f"'dup' (2x: {spec.input}:1, {spec.input}:2)", "response_format: this run's engine cannot constrain", "custom_id 'schema'"):
        assert needle in text, needle
    assert PipelineRun(spec).ledger.read("shard") is None  # nothing recorded: fix the file and run again


async def test_a_request_without_custom_id_is_named_by_its_line_after_a_blank_and_a_malformed_one(tmp_path: Path) -> None:
    """The ``line N`` a refusal names is the file's line, as the quarantine's is: a blank and a
    malformed line before it count (sharding and the full preflight)."""
    spec = openai_spec(tmp_path, [], input_format="openai_batch")
    no_id = chat_line("x", "x")
    del no_id["custom_id"]
    Path(spec.input).write_bytes(b"\n".join([orjson.dumps(chat_line("a", "x")), b"", b'{"custom_id": ',
                                              orjson.dumps(chat_line("b", "y")), orjson.dumps(no_id)]) + b"\n")
    with pytest.raises(InputError) as info:
        await PipelineRun(spec).shard()
    assert "custom_id must be a non-empty string: 1 request(s), e.g. custom_id 'line 5'" in str(info.value), info.value
    (entry,) = JsonlFile(PipelineRun(spec).layout.input_quarantine).iter_records_sync()
    assert entry["line"] == 3
    with pytest.raises(InputError, match="custom_id 'line 5'"):
        preflight(spec, full=True)
    reader = OpenAIBatchReader()
    rows = [reader.convert(rec, line) for line, rec in JsonlFile(spec.input).iter_numbered_sync(
        on_error="quarantine", quarantine=lambda entry: None)]
    assert [r["id"] for r in rows] == ["a", "b", "line-5"]


async def test_a_refusal_names_the_file_and_lines_of_its_malformed_lines_and_duplicates(tmp_path: Path) -> None:
    """Problems of the file rather than of one request line (lines that are no JSON object,
    a duplicated custom_id) are named too: by file and line (a duplicate by its id and the
    file:line of each occurrence); no empty 'e.g.'."""
    spec = openai_spec(tmp_path, [], input_format="openai_batch")
    Path(spec.input).write_bytes(b"\n".join([orjson.dumps(chat_line("a", "x")), b'{"custom_id": ',
                                              orjson.dumps(chat_line("a", "y")), b"[1]"]) + b"\n")
    with pytest.raises(InputError) as sharded:
        await PipelineRun(spec).shard()
    with pytest.raises(InputError) as checked:
        preflight(spec, full=True)
    for text in (str(sharded.value), str(checked.value)):
        assert f"lines that are not JSON objects (quarantined at sharding): 2 line(s), e.g. {spec.input} line 2, 4\n" in text, text
        assert text.endswith("duplicate custom_id (each must be unique: it is the record id): 2 request(s), "
                             f"e.g. custom_id 'a' (2x: {spec.input}:1, {spec.input}:3)"), text


async def test_preflight_and_sharding_read_lines_alike(tmp_path: Path) -> None:
    """One typed line model and one id rule: the full preflight refuses a file with exactly the
    sharding pass's problems (structure, body fields, duplicates)."""
    lines = [
        chat_line("ok", "x"), chat_line("ok", "y"),
        {"method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}},  # no custom_id
        chat_line("get", "x") | {"method": "GET"},
        {"custom_id": "str-body", "method": "POST", "url": "/v1/chat/completions", "body": "hello"},
        {"custom_id": "two-prompts", "method": "POST", "url": "/v1/completions", "body": {"model": "tiny", "prompt": ["a", "b"]}},
        chat_line("extra", "x") | {"priority": 1},
    ]
    spec = openai_spec(tmp_path, lines, input_format="openai_batch")
    with pytest.raises(InputError) as checked:
        preflight(spec, full=True)
    with pytest.raises(InputError) as sharded:
        await PipelineRun(spec).shard()
    assert str(checked.value) == str(sharded.value)
    text = str(sharded.value)
    for needle in ("custom_id must be a non-empty string: 1 request(s), e.g. custom_id 'line 3'", "method 'GET' (only POST)",
                   "body must be an object: 1 request(s), e.g. custom_id 'str-body'", "body.prompt must be one string",
                   "unsupported line keys ['priority']", f"'ok' (2x: {spec.input}:1, {spec.input}:2)"):
        assert needle in text, needle


async def test_model_aliases_and_unchecked_models(tmp_path: Path) -> None:
    line = chat_line("a", "x") | {"body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x"}]}}
    spec = openai_spec(tmp_path, [line], openai_batch={"model": "tiny", "model_aliases": ["gpt-4o-mini"]})
    assert (await PipelineRun(spec).shard()).records == 1
    spec = openai_spec(tmp_path, [line], run="unchecked", openai_batch={"check_model": False})
    assert (await PipelineRun(spec).shard()).records == 1


def test_export_command_from_a_run_url(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from batch_inference.cli.main import cli

    import yaml

    spec = openai_spec(tmp_path, [chat_line(f"r{i}", "q") for i in range(30)], max_rounds=1)
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec.public_dict() | {"storage_options": {}}))
    ran = CliRunner().invoke(cli, ["run", str(spec_path)])
    assert ran.exit_code in (0, 3), ran.output
    assert "is an OpenAI Batch file (detected; input_format auto)" in " ".join(ran.output.split())
    result = CliRunner().invoke(cli, ["export", f"{spec.output}/{spec.run}", "--out", str(tmp_path / "exp")])
    assert result.exit_code == 0, result.output
    out, errors = read_jsonl(str(tmp_path / "exp" / "output.jsonl")), read_jsonl(str(tmp_path / "exp" / "errors.jsonl"))
    assert len(out) + len(errors) == 30 and f"{len(out)} answered" in result.output
    assert all(e["error"]["code"] == "exhausted" for e in errors)
    unfinished = CliRunner().invoke(cli, ["export", str(tmp_path / "out" / "nope")])
    assert unfinished.exit_code == 1 and "not a pipeline run" in unfinished.output


async def test_in_place_max_attempts_and_quarantined_shards_are_errors(tmp_path: Path) -> None:
    lines = [chat_line(f"r{i}", f"q{i}") for i in range(40)]
    spec = openai_spec(tmp_path, lines, strategy="in_place", max_attempts=2, approval=0.3)
    summary = await run_pipeline(spec)
    exported = export_openai_batch(PipelineRun(spec))
    errors = read_jsonl(exported.errors_url)
    assert exported.errors_by_code == {"max_attempts": summary.max_attempts} and summary.max_attempts > 0
    assert all("not approved after 2 attempt(s)" in e["error"]["message"] for e in errors)

    # one judge shard fails for good: its records are quarantined, each an error line
    from batch_inference.pipeline import open_runner
    from batch_inference_tests.pipeline.helpers import FailingShardRunner

    (tmp_path / "q").mkdir()
    spec = openai_spec(tmp_path / "q", lines, run="quarantined", shard_records=20, max_rounds=1)
    async with open_runner(spec) as pool:
        runner = FailingShardRunner(pool, shard_name="round-00/inferred/part-00001.jsonl.zst", kind="judge")
        summary = await run_pipeline(spec, runner=runner)
    assert summary.status == "quarantined" and summary.failed == 20
    exported = export_openai_batch(PipelineRun(spec))
    errors = read_jsonl(exported.errors_url)
    assert exported.errors_by_code["shard_quarantined"] == 20 and exported.requests == 40
    quarantined = [e for e in errors if e["error"]["code"] == "shard_quarantined"]
    assert all("device lost" in e["error"]["message"] for e in quarantined)
    ids = [e["custom_id"] for e in errors] + [x["custom_id"] for x in read_jsonl(exported.output_url)]
    assert sorted(ids) == sorted(x["custom_id"] for x in lines)


async def test_a_stopped_run_exports_the_rest_as_errors_of_the_given_code(tmp_path: Path) -> None:
    """``unfinished``: a run stopped before its end (a cancelled batch) still puts every request in one file."""
    from batch_inference.pipeline import StepOrderError

    lines = [chat_line(f"r{i}", f"question {i}") for i in range(30)]
    spec = openai_spec(tmp_path, lines, strategy="in_place", max_attempts=1, shard_records=10,
                       judge={"kind": "rule", "callable": "min_length", "kwargs": {"min_chars": 0}})
    run = PipelineRun(spec)
    await run.shard()
    with pytest.raises(StepOrderError):
        export_openai_batch(run)
    exported = export_openai_batch(run, unfinished=("batch_cancelled", "the batch was cancelled"))
    assert exported.output == 0 and exported.errors_by_code == {"batch_cancelled": 30}
    # after a full run nothing is left for the code: each request is where the run put it
    await run_pipeline(spec)
    exported = export_openai_batch(PipelineRun(spec), unfinished=("batch_cancelled", "the batch was cancelled"))
    assert exported.output == 30 and exported.errors == 0
    ids = [x["custom_id"] for x in read_jsonl(exported.output_url)]
    assert sorted(ids) == sorted(x["custom_id"] for x in lines)
