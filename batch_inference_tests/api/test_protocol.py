"""The typed edge of the Batch API: a batch's stored state loads from any version's JSON, and a
batch's input is validated once, line by line, by the endpoint and the pipeline's typed line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from batch_inference.api.config import ApiConfig
from batch_inference.api.intake import split_requests
from batch_inference.api.protocol import BatchRecord
from batch_inference.api.store import Store
from batch_inference_tests.api.helpers import chat_line, jsonl, write_config

# a state.json as the release before projects wrote it: no project, no delivering, the model under "run"
BEFORE_PROJECTS: dict[str, Any] = {
    "id": "batch_abc", "object": "batch", "api": "openai", "endpoint": "/v1/chat/completions", "input_file_id": "file_x",
    "source_url": "/data/files/file_x/content", "completion_window": "24h", "status": "completed", "created_at": 10,
    "created_ns": 10_000, "expires_at": 86410, "in_progress_at": 11, "finalizing_at": 12, "completed_at": 13, "failed_at": None,
    "expired_at": None, "cancelling_at": None, "cancelled_at": None, "output_file_id": "file_abcoutput", "error_file_id": None,
    "errors": None, "metadata": {"team": "search"}, "model": "tiny", "output_expires_after": None,
    "request_counts": {"total": 3, "completed": 3, "failed": 0}, "stopped": 0, "run": "tiny",
    "usage": {"input_tokens": 9, "output_tokens": 12, "total_tokens": 21,
              "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}},
}


def test_state_from_before_projects_loads_and_keeps_its_json_form() -> None:
    record = BatchRecord.load(BEFORE_PROJECTS)
    assert record.project == "default" and record.run_model == "tiny" and record.request_counts.completed == 3
    assert record.ended and record.delivering is None
    again = record.to_json()
    assert again["run"] == "tiny" and "run_model" not in again
    assert {k: again[k] for k in BEFORE_PROJECTS} == BEFORE_PROJECTS  # every key it had, as it had it
    # a key this version does not know (a newer server's) survives a round trip
    newer = BatchRecord.load({**BEFORE_PROJECTS, "project": "team-a", "deadline_at": 99})
    assert newer.to_json()["deadline_at"] == 99 and newer.changed(stopped=1).to_json()["deadline_at"] == 99
    # the OpenAI batch object holds OpenAI's fields only
    public = record.public()
    assert public["id"] == "batch_abc" and not {"run", "api", "source_url", "project", "created_ns", "delivering"} & set(public)


def _intake(tmp_path: Path, lines: list[dict[str, Any]], endpoint: str = "/v1/chat/completions") -> tuple[Any, list[dict[str, Any]],
                                                                                                          list[dict[str, Any]]]:
    config = ApiConfig.load(write_config(tmp_path))
    store = Store(config.storage, config.storage_options)
    source = store.url("files", "file_in", "content")
    w = store.open_writer(source)
    w.write(jsonl(lines))
    w.commit()
    record = BatchRecord(id="batch_in", endpoint=endpoint, source_url=source, completion_window="24h", created_at=0)
    checked = split_requests(config, store, record)
    read = [[orjson.loads(x) for x in store.lines(f"{store.batch_dir(record.id)}/{name}.jsonl") if x.strip()]
            for name in ("input", "rejected")]
    return checked, read[0], read[1]


def test_a_line_is_checked_once_by_the_pipelines_typed_line_and_refused_alone(tmp_path: Path) -> None:
    """A ``response_format`` on an engine that cannot constrain failed the whole batch (the
    pipeline refused the file); the typed line's check now refuses that line alone."""
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    lines = [chat_line("ok", "x"), chat_line("schema", "x", response_format=schema), chat_line("tools", "x", tools=[]),
             chat_line("plain", "x", response_format={"type": "text"})]
    checked, runs, refused = _intake(tmp_path, lines)
    assert not checked.problems and checked.total == 4 and checked.runnable == 2 and checked.model == "tiny"
    assert [x["custom_id"] for x in runs] == ["ok", "plain"] and runs[0] == lines[0]
    errors = {x["custom_id"]: x["response"]["body"]["error"] for x in refused}
    assert errors["schema"]["param"] == "response_format" and "cannot constrain" in errors["schema"]["message"]
    assert errors["tools"]["param"] == "tools"


def test_file_level_problems_fail_the_batch_with_their_lines(tmp_path: Path) -> None:
    lines = [chat_line("a", "x"), {**chat_line("get", "x"), "method": "GET"}, {**chat_line("", "x")},
             {**chat_line("other", "x"), "url": "/v1/completions"}]
    checked, _, _ = _intake(tmp_path, lines)
    assert [(p["code"], p["line"]) for p in checked.problems] == [("invalid_method", 2), ("missing_custom_id", 3), ("invalid_url", 4)]
    assert "method 'GET'" in checked.problems[0]["message"]
