"""The row schema module: one place for result fields, statuses and error kinds."""

from __future__ import annotations

from pathlib import Path

import orjson

from batch_inference import rows
from batch_inference.rows import ErrorKind, Status
from batch_inference.storage import JsonlDir


def test_error_kinds_read_back_from_tagged_strings() -> None:
    assert ErrorKind.of("prompt_too_long: 5000 prompt tokens + 64 > 2048") is ErrorKind.PROMPT_TOO_LONG
    assert ErrorKind.of("missing_field: template field {q} not found in record 'a'") is ErrorKind.MISSING_FIELD
    assert ErrorKind.of("unparseable_verdict") is ErrorKind.UNPARSEABLE_VERDICT
    assert ErrorKind.of("OSError: disk gone") is None and ErrorKind.of(None) is None
    assert ErrorKind.INFERENCE_ERROR.tag("engine_error: boom") == "inference_error: engine_error: boom"
    assert ErrorKind.PROMPT_TOO_LONG.permanent and not ErrorKind.ENGINE_ERROR.permanent
    assert rows.permanent_error({"error": "empty_prompt: no tokens"}) == "empty_prompt: no tokens"
    assert rows.permanent_error({"error": "engine_error: CUDA OOM"}) is None
    assert rows.error_text(ValueError("missing_field: x")) == "missing_field: x"
    assert rows.error_text(ValueError("boom")) == "ValueError: boom"


def test_statuses_serialise_as_their_names() -> None:
    assert orjson.dumps({"status": Status.MAX_ATTEMPTS}) == b'{"status":"max_attempts"}'
    assert [str(s) for s in rows.TERMINAL_STATES] == ["approved", "exhausted", "max_attempts", "failed"]


def test_a_new_output_field_is_one_edit(monkeypatch, tmp_path: Path) -> None:
    """Adding a field to RESULT_FIELDS makes both the pool's tasks and the pipeline's
    recompaction drop it from the next round's input."""
    from batch_inference.pipeline import passes
    from batch_inference.pool import tasks

    monkeypatch.setattr(rows, "RESULT_FIELDS", (*rows.RESULT_FIELDS, "score"))
    row = {"id": "a", "prompt": "p", "result": "r", "score": 0.3, "attempts": 1}
    assert tasks._clean(row) == {"id": "a", "prompt": "p", "attempts": 1}
    with JsonlDir(str(tmp_path / "rejected")).writer_sync(compression="zstd") as w:
        w.write(row)
    passes.recompact(str(tmp_path / "rejected"), str(tmp_path / "pending"), records_per_shard=10)
    assert list(JsonlDir(str(tmp_path / "pending")).iter_records_sync()) == [{"id": "a", "prompt": "p", "attempts": 1}]


def test_a_kind_made_permanent_is_one_edit(monkeypatch, tmp_path: Path) -> None:
    """Marking an error kind permanent (rows.PERMANENT) sends its rows to failed-records."""
    from batch_inference.pipeline import passes

    monkeypatch.setattr(rows, "PERMANENT", rows.PERMANENT | {ErrorKind.ENGINE_ERROR})
    with JsonlDir(str(tmp_path / "rejected")).writer_sync(compression="zstd") as w:
        w.write({"id": "a", "error": "engine_error: always", "result": None})
        w.write({"id": "b", "error": None, "result": "no"})
    records, _, _ = passes.recompact(str(tmp_path / "rejected"), str(tmp_path / "pending"), records_per_shard=10,
                                     failed_dst=str(tmp_path / "failed"), round=0)
    assert records == 1
    (failed,) = JsonlDir(str(tmp_path / "failed")).iter_records_sync()
    assert failed["id"] == "a" and failed["status"] == Status.FAILED and failed["reason"] == "engine_error: always"
