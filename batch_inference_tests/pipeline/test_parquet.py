"""A Parquet dataset through the whole pipeline: validate, run, export to Parquet with every
row once and every column intact; chat prompts from a ``messages`` column; corrupt files."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from batch_inference.cli.pipeline_cmds import export, validate
from batch_inference.pipeline import PipelineRun, RunLayout, run_pipeline
from batch_inference.pipeline.inputs import InputError
from batch_inference.pipeline.parquet_export import export_parquet
from batch_inference.pipeline.preflight import preflight
from batch_inference.storage import JsonlFile
from batch_inference_tests.faults.helpers import make_spec, spec_data, write_input
from batch_inference_tests.storage.helpers import broken_row_group, every_type

STATUSES = {"approved", "exhausted", "max_attempts", "failed"}


def dataset(folder: Path, files: int = 3, rows: int = 500) -> pa.Table:
    """``files`` Parquet files of ``rows`` rows each (every column type, a prompt, an int id);
    returns the whole table in input order."""
    folder.mkdir(parents=True)
    tables = []
    for f in range(files):
        t = every_type(rows)
        t = t.set_column(0, "id", pa.array(range(f * rows, (f + 1) * rows), pa.int64()))
        t = t.append_column("prompt", pa.array([f"question {f}-{i} ¿qué?" for i in range(rows)]))
        pq.write_table(t, folder / f"part-{f:02d}.parquet", row_group_size=128)
        tables.append(pq.read_table(folder / f"part-{f:02d}.parquet"))
    return pa.concat_tables(tables)


@pytest.mark.parametrize("strategy", ["rounds", "in_place"])
async def test_a_parquet_folder_runs_and_exports_every_row_once_with_its_columns(tmp_path: Path, strategy: str) -> None:
    """1,500 rows in three files: validate counts them, the run conserves them, and the Parquet
    export holds each row once with its input columns in their own Arrow types, plus
    status, result, error and attempts."""
    table = dataset(tmp_path / "drop")
    spec = make_spec(tmp_path, input=str(tmp_path / "drop"), strategy=strategy, max_rounds=2, max_attempts=2,
                     shard_records=200)
    plan = preflight(spec, full=True)
    assert (plan.input_format, plan.format_detected, plan.records, plan.checked_records) == ("parquet", True, 1500, 8)
    summary = await run_pipeline(spec)
    assert summary.records == 1500 and summary.conservation["ok"]
    run = PipelineRun(spec)
    done = export_parquet(run)
    out = pq.read_table(done.out_url)
    assert out.num_rows == 1500 == done.records and sorted(out["id"].to_pylist()) == list(range(1500))
    assert out.schema.names == table.schema.names + ["status", "result", "error", "attempts"]
    back = out.sort_by("id").select(table.schema.names)
    assert back.schema == table.schema
    assert back.equals(table)  # every column intact: nested, nulls, timestamps, decimals, binary, non-ASCII
    status = out["status"].to_pylist()
    assert set(status) <= STATUSES and "approved" in status and len(set(status)) > 1, set(status)
    approved = pc.equal(out["status"], "approved")
    assert pc.all(pc.invert(pc.is_null(pc.filter(out["result"], approved)))).as_py()
    assert pc.all(pc.is_null(pc.filter(out["result"], pc.invert(approved)))).as_py()
    assert pc.all(pc.is_null(pc.filter(out["error"], approved))).as_py()
    assert pc.min(out["attempts"]).as_py() >= 1 and pc.max(out["attempts"]).as_py() <= 2
    assert done.by_status == {k: status.count(k) for k in set(status)}
    assert run.ledger.read(RunLayout.INPUT_SCHEMA)["rows"] == 1500


async def test_a_messages_column_is_a_chat_prompt(tmp_path: Path) -> None:
    folder = tmp_path / "chat"
    folder.mkdir()
    msgs = pa.array([[{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Wie heißt {i}?"}]
                     for i in range(40)])
    pq.write_table(pa.table({"messages": msgs, "lang": ["de"] * 40}), folder / "chat.parquet")
    spec = make_spec(tmp_path, input=str(folder), infer={"template": None, "sampling": {"max_tokens": 8}}, run="chat")
    assert spec.infer.source == "record"
    plan = preflight(spec)
    assert plan.chat and plan.prompt == "record"
    summary = await run_pipeline(spec)
    assert summary.records == 40 and summary.conservation["ok"] and summary.failed == 0
    out = pq.read_table(export_parquet(PipelineRun(spec)).out_url)
    assert out.schema.field("messages").type == msgs.type and sorted(out["id"].to_pylist()) == [f"{i:012d}" for i in range(40)]


def test_a_corrupt_parquet_file_is_refused_by_validate_naming_it(tmp_path: Path) -> None:
    dataset(tmp_path / "drop", files=2, rows=50)
    good = (tmp_path / "drop" / "part-01.parquet").read_bytes()
    (tmp_path / "drop" / "part-01.parquet").write_bytes(good[:-100])  # cut: the footer is gone
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec_data(tmp_path, input=str(tmp_path / "drop"))))
    result = CliRunner().invoke(validate, [str(spec_path)], terminal_width=200)
    assert result.exit_code == 1, result.output
    assert "part-01.parquet: not a readable Parquet file" in result.output and "can run" not in result.output


async def test_a_parquet_file_that_breaks_mid_run_has_its_rows_quarantined_naming_the_file(tmp_path: Path) -> None:
    """The footer reads (validate passes), a row group does not: its 100 rows are quarantined at
    sharding with the file and row named; the other 200 run and are conserved, and the export
    accounts for all 300."""
    folder = tmp_path / "drop"
    folder.mkdir()
    broken_row_group(folder / "part-0.parquet")
    spec = make_spec(tmp_path, input=str(folder))
    plan = preflight(spec, full=True)
    assert plan.records == 200
    summary = await run_pipeline(spec)
    assert summary.records == 200 and summary.conservation["ok"]
    entries = list(JsonlFile(RunLayout(spec.output, spec.run).input_quarantine).iter_records_sync())
    assert len(entries) == 100 and {e["file"] for e in entries} == {str(folder / "part-0.parquet")}
    assert [e["line"] for e in entries] == list(range(101, 201)) and "row group 1" in entries[0]["reason"]
    # every input row is in the export: the 100 left out as failed rows naming their file and row
    rows = pq.read_table(export_parquet(PipelineRun(spec)).out_url).to_pylist()
    failed = [r for r in rows if r["status"] == "failed"]
    assert len(rows) == 300 and len(failed) == 100
    assert failed[0]["error"].startswith(f"malformed_line: {folder / 'part-0.parquet'}:101: ")


async def test_input_format_parquet_names_an_input_that_is_not(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, input_format="parquet")
    with pytest.raises(InputError, match="input_format: parquet, but .*input.jsonl is not a Parquet file or folder"):
        preflight(spec)


async def test_a_jsonl_run_exports_to_parquet_with_inferred_types(tmp_path: Path) -> None:
    ids = write_input(tmp_path / "input.jsonl", 120)
    spec = make_spec(tmp_path, input=str(tmp_path / "input.jsonl"))
    await run_pipeline(spec)
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec_data(tmp_path, input=str(tmp_path / "input.jsonl"))))
    result = CliRunner().invoke(export, [str(spec_path), "--format", "parquet", "--out", str(tmp_path / "pq")])
    assert result.exit_code == 0 and "120 records ->" in result.output, result.output
    out = pq.read_table(tmp_path / "pq")
    assert sorted(out["id"].to_pylist()) == ids and out.schema.field("prompt").type == pa.string()


async def test_the_spec_asks_for_parquet_when_the_run_finishes(tmp_path: Path) -> None:
    dataset(tmp_path / "drop", files=1, rows=60)
    spec = make_spec(tmp_path, input=str(tmp_path / "drop"), export=["parquet", "openai_batch"])
    await run_pipeline(spec)
    layout = RunLayout(spec.output, spec.run)
    assert pq.read_table(layout.parquet_export).num_rows == 60
    assert JsonlFile(f"{layout.openai_export}/output.jsonl").exists_sync()


async def test_a_null_in_an_integer_id_column_is_given_an_id_and_exported_null(tmp_path: Path) -> None:
    folder = tmp_path / "drop"
    folder.mkdir()
    pq.write_table(pa.table({"id": pa.array([7, None, 9], pa.int64()), "prompt": ["a", "b", "c"]}), folder / "x.parquet")
    spec = make_spec(tmp_path, input=str(folder))
    summary = await run_pipeline(spec)
    assert summary.records == 3 and summary.conservation["ok"]
    out = pq.read_table(export_parquet(PipelineRun(spec)).out_url).sort_by("prompt")
    assert out["id"].to_pylist() == [7, None, 9] and out.schema.field("id").type == pa.int64()


def test_the_planner_sizes_a_parquet_input_from_its_footers(tmp_path: Path) -> None:
    from batch_inference.planning.sizing import input_size, prefix_windows

    dataset(tmp_path / "drop", files=2, rows=300)
    spec = make_spec(tmp_path, input=str(tmp_path / "drop"))
    size = input_size(spec, sample=50)
    assert (size.records, size.how, len(size.sample)) == (600, "Parquet footers", 50)
    assert all("prompt" in r for r in size.sample)
    records, where = prefix_windows(spec, k=100, windows=4)
    assert len(records) == 100 and "evenly spaced over its 600" in where


def test_inspect_counts_a_parquet_folder_from_its_footers_and_refuses_a_corrupt_file(tmp_path: Path) -> None:
    from batch_inference.cli.storage_cmds import inspect

    dataset(tmp_path / "drop", files=3, rows=500)
    shown = CliRunner().invoke(inspect, [str(tmp_path / "drop")], terminal_width=200)
    assert shown.exit_code == 0 and "shards: 3  records: 1,500" in shown.output and "Parquet footers" in shown.output, shown.output
    (tmp_path / "drop" / "part-02.parquet").write_bytes(b"PAR1 not really")
    bad = CliRunner().invoke(inspect, [str(tmp_path / "drop")], terminal_width=200)
    assert bad.exit_code == 1 and "part-02.parquet: not a readable Parquet file" in bad.output, bad.output
