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


async def test_a_new_output_field_is_one_edit(monkeypatch, tmp_path: Path, inprocess_pool) -> None:
    """Adding a field to RESULT_FIELDS makes both the pool's tasks and the pipeline's
    recompaction drop it from the next round's input."""
    from batch_inference.pipeline import passes
    from batch_inference_tests.fixtures.pool import infer_spec, read_rows, write_shard

    monkeypatch.setattr(rows, "RESULT_FIELDS", (*rows.RESULT_FIELDS, "score"))
    write_shard(tmp_path / "in.jsonl", 1, prefix="a", score=0.3)
    async with inprocess_pool() as pool:
        await pool.run_task(infer_spec("t", tmp_path / "in.jsonl", tmp_path / "inferred.jsonl"))
    (inferred,) = read_rows(tmp_path / "inferred.jsonl")
    assert "score" not in inferred and inferred["result"] and inferred["q"].startswith("question a000000")
    row = {"id": "a", "prompt": "p", "result": "r", "score": 0.3, "attempts": 1}
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
    records, _, _, _ = passes.recompact(str(tmp_path / "rejected"), str(tmp_path / "pending"), records_per_shard=10,
                                     failed_dst=str(tmp_path / "failed"), round=0)
    assert records == 1
    (failed,) = JsonlDir(str(tmp_path / "failed")).iter_records_sync()
    assert failed["id"] == "a" and failed["status"] == Status.FAILED and failed["reason"] == "engine_error: always"


def _tag_literals(source: str) -> list[tuple[int, str]]:
    """String literals (f-string parts included) that start with an error kind's tag, or
    with a near miss of one (``prompt_to_long:``): such a literal spells a tag by hand."""
    import ast
    import difflib
    import re

    kinds = [k.value for k in ErrorKind]
    head = re.compile(r"\s*([a-z][a-z0-9]*(?:_[a-z0-9]+)+)\s*(?::|$)")
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and (m := head.match(node.value)):
            if difflib.get_close_matches(m.group(1), kinds, n=1, cutoff=0.85):
                found.append((node.lineno, node.value))
    return found


def test_no_error_tag_is_a_string_literal_outside_rows() -> None:
    """Tags are written (``ErrorKind.X.tag``) and read (``ErrorKind.of`` / ``parse``) through
    the enum, where a misspelt kind is an AttributeError; a literal would be a silent typo."""
    import batch_inference

    package = Path(batch_inference.__file__).parent
    hits = [f"{path.relative_to(package.parent)}:{line}: {text[:60]!r}"
            for path in sorted(package.rglob("*.py")) if path.name != "rows.py"
            for line, text in _tag_literals(path.read_text())]
    assert hits == []


def test_the_literal_scan_sees_tags_and_their_typos() -> None:
    assert _tag_literals('e = "engine_error: boom"') == [(1, "engine_error: boom")]
    assert _tag_literals('e = f"prompt_to_long: {n} tokens"') == [(1, "prompt_to_long: ")]
    assert _tag_literals('if kind == "unparseable_verdict": pass') == [(1, "unparseable_verdict")]
    assert _tag_literals('e = f"{field}: must be an object"; f = "record_id: x"; """engine_error is retryable."""') == []


def test_a_misspelt_tag_cannot_pass_as_a_retryable_error() -> None:
    """An untagged item error reads as retryable, so an engine's per-item error must carry a
    kind: ``Completion.failed`` refuses a misspelt tag instead of letting it retry."""
    import pytest

    from batch_inference.engines.base import Completion

    assert ErrorKind.of("prompt_to_long: 5000 prompt tokens") is None  # a typo reads as untagged ...
    with pytest.raises(ValueError, match="ErrorKind tag"):  # ... so no item error may be written that way
        Completion.failed("prompt_to_long: 5000 prompt tokens")
    assert Completion.failed(ErrorKind.PROMPT_TOO_LONG.tag("5000 prompt tokens")).error == "prompt_too_long: 5000 prompt tokens"
    assert ErrorKind.parse("rule_error: KeyError: 'q'") == (ErrorKind.RULE_ERROR, "KeyError: 'q'")
    assert ErrorKind.parse("unparseable_verdict") == (ErrorKind.UNPARSEABLE_VERDICT, "")
    assert ErrorKind.parse("OSError: gone") is None and ErrorKind.parse(None) is None
