"""Issue 28 item 2: every input line is accounted for from ``validate`` to ``export``, through
the CLI. Malformed lines are counted and named by file:line (never a crash) and end in the
exports; a duplicate id is warned about wherever the user looks (``pipeline.accounting``)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from batch_inference.cli.main import cli
from batch_inference_tests.pipeline.helpers import spec_dict

LINES = 200
BAD = (10, 90, 150)  # 0-based: file lines 11, 91, 151


@pytest.fixture
def spec_path(tmp_path: Path) -> Path:
    """200 lines: 3 malformed, and the last one repeats the id of line 6."""
    src = tmp_path / "evalset.jsonl"
    with open(src, "wb") as f:
        for i in range(LINES):
            if i in BAD:
                f.write(b'{"id": "q%d", "prompt": broken\n' % i)
                continue
            f.write(orjson.dumps({"id": "q5" if i == LINES - 1 else f"q{i}", "prompt": f"question number {i}"}) + b"\n")
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec_dict(tmp_path, approval=1.0, shard_records=50, input=str(src))))
    return path


def cli_out(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args), terminal_width=400, env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())  # one line: rich may still wrap a long one


def named(src: Path) -> list[str]:
    return [f"{src}:{i + 1}" for i in BAD]


def test_validate_counts_and_names_malformed_lines_and_duplicate_ids(spec_path: Path) -> None:
    out = cli_out("validate", str(spec_path))
    assert "200 line(s): 197 record(s), 3 malformed (left out)" in out, out
    for name in named(spec_path.parent / "evalset.jsonl"):
        assert name in out, out
    assert "1 id(s) appear more than once in the input: 'q5'" in out, out


def test_plan_counts_malformed_lines_instead_of_crashing(spec_path: Path) -> None:
    out = cli_out("plan", str(spec_path))
    assert "MalformedRecordError" not in out
    assert "input: 200 line(s): 197 record(s), 3 malformed (left out)" in out, out
    assert all(name in out for name in named(spec_path.parent / "evalset.jsonl")), out
    assert "'q5'" in out, out


def test_every_line_is_accounted_for_from_run_to_export(spec_path: Path) -> None:
    src, run_dir = spec_path.parent / "evalset.jsonl", spec_path.parent / "out" / "test-run"
    quarantine = run_dir / "quarantine" / "input.jsonl"
    ran = cli_out("run", str(spec_path))
    shown = cli_out("status", str(run_dir))
    for out in (ran, shown):  # the funnel starts from the input's lines
        assert "│ input │ 200 │" in out and "3 malformed left out" in out, out
        assert "input 200 line(s): 197 record(s), 3 malformed (left out)" in out, out
        assert all(name in out for name in named(src)) and f"kept in {quarantine}" in out, out
        assert "1 id(s) appear more than once in the input: 'q5'" in out, out

    exported = cli_out("export", str(run_dir))
    assert "200 input line(s) = 197 answered + 3 errors (3 of them malformed lines" in exported, exported
    assert "warning: 1 id(s) appear more than once in the input: 'q5'" in exported, exported
    out_dir = run_dir / "export" / "openai_batch"
    answers = [orjson.loads(x) for x in (out_dir / "output.jsonl").read_bytes().splitlines()]
    errors = [orjson.loads(x) for x in (out_dir / "errors.jsonl").read_bytes().splitlines()]
    assert len(answers) + len(errors) == LINES
    assert [a["custom_id"] for a in answers].count("q5") == 2  # each occurrence answered, and said so above
    assert [e["error"]["code"] for e in errors] == ["malformed_line"] * 3
    assert all(e["custom_id"] is None and e["response"] is None for e in errors)
    assert [e["error"]["message"].split(": ")[1] for e in errors] == named(src)

    parquet = cli_out("export", str(run_dir), "--format", "parquet")
    assert "200 records" in parquet and "approved 197, failed 3" in parquet, parquet
    table = pq.read_table(run_dir / "export" / "parquet").to_pylist()
    assert len(table) == LINES
    failed = [r for r in table if r["run"]["status"] == "failed"]
    assert [r["run"]["error"].split(": ")[1] for r in failed] == named(src)
    assert all(r["id"] is None and r["prompt"] is None and r["run"]["result"] is None for r in failed)


def test_validate_holds_a_bounded_number_of_ids_and_says_when_it_stopped(spec_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The full check holds ids in memory to find repeats: past its limit it stops checking
    and says so, rather than growing with the input (the shard step checks every id)."""
    monkeypatch.setattr("batch_inference.pipeline.preflight.ID_CHECK_LIMIT", 100)
    out = cli_out("validate", str(spec_path))
    assert "ids checked for repeats over the first 100 record(s) only (of 197)" in out, out
    assert "'q5'" not in out  # its repeat is line 200, past the limit
