"""A Parquet dataset through the whole pipeline: validate, run, export to Parquet with every
row once and every column intact; chat prompts from a ``messages`` column; corrupt files."""

from __future__ import annotations

from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from batch_inference.cli.pipeline_cmds import export, validate
from batch_inference.pipeline import PipelineRun, RunLayout, run_pipeline
from batch_inference.pipeline.inputs import InputError
from batch_inference.pipeline.parquet_export import RUN_COLUMN, export_parquet, run_column_name
from batch_inference.pipeline.preflight import preflight
from batch_inference.storage import JsonlDir, JsonlFile
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
    export holds each row once, in the input's order, with its input columns in their own Arrow
    types, plus the run's column: status, result, error, attempts, finish_reason, tokens, cached."""
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
    assert out.num_rows == 1500 == done.records and out["id"].to_pylist() == list(range(1500))  # the input's order
    assert out.schema.names == table.schema.names + ["run"] and done.run_column == "run"
    assert out.schema.field("run").type == RUN_COLUMN
    back = out.select(table.schema.names)
    assert back.schema == table.schema
    assert back.equals(table)  # every column intact: nested, nulls, timestamps, decimals, binary, non-ASCII
    status = pc.struct_field(out["run"], "status")
    result, error = pc.struct_field(out["run"], "result"), pc.struct_field(out["run"], "error")
    assert set(status.to_pylist()) <= STATUSES and "approved" in status.to_pylist() and len(set(status.to_pylist())) > 1
    approved = pc.equal(status, "approved")
    assert pc.all(pc.invert(pc.is_null(pc.filter(result, approved)))).as_py()
    assert pc.all(pc.is_null(pc.filter(result, pc.invert(approved)))).as_py()
    assert pc.all(pc.is_null(pc.filter(error, approved))).as_py()
    attempts = pc.struct_field(out["run"], "attempts")
    assert pc.min(attempts).as_py() >= 1 and pc.max(attempts).as_py() <= 2
    # an approved answer's generation: why it ended and its tokens (the tail clears a spent attempt's)
    assert set(pc.filter(pc.struct_field(out["run"], "finish_reason"), approved).to_pylist()) <= {"stop", "length"}
    assert pc.min(pc.filter(pc.struct_field(out["run"], "prompt_tokens"), approved)).as_py() > 0
    assert done.by_status == {k: status.to_pylist().count(k) for k in set(status.to_pylist())}
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
    failed = [r for r in rows if r["run"]["status"] == "failed"]
    assert len(rows) == 300 and len(failed) == 100
    assert rows.index(failed[0]) == 100  # in the input's order: the damaged row group's rows are rows 101-200
    assert failed[0]["run"]["error"].startswith(f"malformed_line: {folder / 'part-0.parquet'}:101: ")


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


def _run_of(out: pa.Table, field: str) -> list:
    return pc.struct_field(out[run_column_name([n for n in out.schema.names if not n.startswith("run")])], field).to_pylist()


async def test_input_columns_named_like_the_runs_own_fields_come_back_as_they_went_in(tmp_path: Path) -> None:
    """Columns named as fields the run writes (status, result, finish_reason, cached, round,
    usage, attempts) and one named ``run``: a template reads the input's ``status``, and the
    export gives every column back unchanged, the run's fields in their own column ``run_``."""
    folder = tmp_path / "drop"
    folder.mkdir()
    n = 60
    table = pa.table({
        "prompt": [f"ticket {i}" for i in range(n)],
        "status": ["open" if i % 2 else "closed" for i in range(n)],
        "result": [f"resolved by {i}" for i in range(n)],
        "finish_reason": ["user"] * n,
        "cached": pa.array(list(range(n)), pa.int16()),
        "round": pa.array([i % 3 for i in range(n)], pa.int64()),
        "attempts": pa.array([9] * n, pa.int8()),
        "usage": pa.array([{"cpu_s": float(i), "tags": ["a", "b"]} for i in range(n)]),
        "run": [f"batch-{i % 4}" for i in range(n)],
    })
    pq.write_table(table, folder / "tickets.parquet")
    spec = make_spec(tmp_path, input=str(folder), max_rounds=2,
                     infer={"template": "Ticket {prompt} is {status}, round {round}: {result}"})
    summary = await run_pipeline(spec)
    assert summary.records == n and summary.conservation["ok"] and summary.failed == 0  # no missing_field
    done = export_parquet(PipelineRun(spec))
    out = pq.read_table(done.out_url)
    assert done.run_column == "run_" and out.schema.names == table.schema.names + ["id", "run_"]
    assert out.select(table.schema.names).equals(table)  # the input's values and types, in its order
    status = pc.struct_field(out["run_"], "status").to_pylist()
    assert set(status) <= STATUSES and "approved" in status
    assert not set(pc.struct_field(out["run_"], "result").to_pylist()) & set(table["result"].to_pylist())


async def test_a_jsonl_input_keeps_its_fields_named_like_the_runs(tmp_path: Path) -> None:
    src = tmp_path / "input.jsonl"
    recs = [{"id": f"r{i}", "prompt": f"q {i}", "status": "draft", "usage": {"seats": i}, "error": None} for i in range(30)]
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    spec = make_spec(tmp_path, input=str(src), max_rounds=2)
    await run_pipeline(spec)
    out = pq.read_table(export_parquet(PipelineRun(spec)).out_url)
    assert out.select(["id", "prompt", "status", "usage"]).to_pylist() == [
        {k: r[k] for k in ("id", "prompt", "status", "usage")} for r in recs]
    assert set(pc.struct_field(out["run"], "status").to_pylist()) <= STATUSES


async def test_nan_and_infinities_in_float_columns_survive_the_round_trip(tmp_path: Path) -> None:
    folder = tmp_path / "drop"
    folder.mkdir()
    nan, inf = float("nan"), float("inf")
    table = pa.table({
        "prompt": [f"p{i}" for i in range(6)],
        "score": pa.array([1.5, nan, inf, -inf, None, 0.0], pa.float64()),
        "weight": pa.array([nan, 2.0, None, -inf, inf, nan], pa.float32()),
        "series": pa.array([[nan, 1.0], [inf], None, [], [-inf, None], [2.0]], pa.list_(pa.float64())),
        "stats": pa.array([{"mean": nan}, {"mean": 1.0}, None, {"mean": -inf}, {"mean": inf}, {"mean": None}]),
    })
    pq.write_table(table, folder / "scores.parquet")
    spec = make_spec(tmp_path, input=str(folder))
    await run_pipeline(spec)
    out = pq.read_table(export_parquet(PipelineRun(spec)).out_url).select(table.schema.names)
    assert out.schema == table.schema
    assert repr(out.to_pylist()) == repr(table.to_pylist())  # nan, inf, -inf and None each where they were
    assert pc.is_nan(out["score"]).to_pylist() == [False, True, False, False, None, False]


async def test_id_field_names_the_id_column(tmp_path: Path) -> None:
    """``id_field: review_id``: the ids are that column's (duplicates warned about, a null one
    left out naming its file and row), the input's own ``id`` column is kept as it was, and the
    export's id column is the user's."""
    folder = tmp_path / "drop"
    folder.mkdir()
    review_ids = [f"rv-{i}" for i in range(20)]
    review_ids[5] = "rv-3"  # a repeat
    review_ids[9] = None  # no id
    table = pa.table({"review_id": review_ids, "id": pa.array(range(100, 120), pa.int32()),
                      "prompt": [f"review {i}" for i in range(20)]})
    pq.write_table(table, folder / "reviews.parquet")
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec_data(tmp_path, input=str(folder), id_field="review_id")))
    checked = CliRunner().invoke(validate, [str(spec_path)], terminal_width=200)
    assert checked.exit_code == 0, checked.output
    assert "the column 'review_id' (id_field" in checked.output and "1 id(s) repeated" in checked.output
    assert "1 id(s) appear more than once in the input: 'rv-3'" in checked.output
    assert f"{folder / 'reviews.parquet'}:10" in checked.output  # the row without an id, named
    spec = make_spec(tmp_path, input=str(folder), id_field="review_id")
    summary = await run_pipeline(spec)
    assert summary.records == 19 and summary.conservation["ok"]
    results = [r["id"] for r in JsonlDir(RunLayout(spec.output, spec.run).results).iter_records_sync()]
    assert sorted(results) == sorted(i for i in review_ids if i is not None)
    done = export_parquet(PipelineRun(spec))
    out = pq.read_table(done.out_url)
    assert out.schema.names == ["review_id", "id", "prompt", "run"]
    kept = [i for i in range(20) if i != 9]
    assert out.select(["review_id", "id", "prompt"]).take(kept).equals(table.take(kept))
    assert out.select(["review_id", "id", "prompt"]).slice(9, 1).to_pylist() == [{"review_id": None, "id": None, "prompt": None}]
    assert any("'rv-3'" in note for note in done.notes)
    errors = pc.struct_field(out["run"], "error").to_pylist()
    assert errors[9].startswith(f"malformed_line: {folder / 'reviews.parquet'}:10: no id: the id column 'review_id'")


async def test_id_field_on_jsonl_names_the_line_without_one(tmp_path: Path) -> None:
    src = tmp_path / "input.jsonl"
    recs = [{"ticket": f"t{i}", "prompt": f"q {i}"} for i in range(10)]
    del recs[4]["ticket"]
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    spec = make_spec(tmp_path, input=str(src), id_field="ticket")
    summary = await run_pipeline(spec)
    assert summary.records == 9
    entries = list(JsonlFile(RunLayout(spec.output, spec.run).input_quarantine).iter_records_sync())
    assert [(e["file"], e["line"]) for e in entries] == [(str(src), 5)] and "'ticket' (id_field) is missing" in entries[0]["reason"]
    out = pq.read_table(export_parquet(PipelineRun(spec)).out_url)
    assert out["ticket"].to_pylist() == [r.get("ticket") for r in recs] and "id" not in out.schema.names


async def test_the_parquet_export_says_why_each_generation_ended_in_input_order(tmp_path: Path) -> None:
    """Every answer cut at max_tokens: the export says ``length`` and the token counts, row by
    row in the input's order, approved and exhausted rows interleaved as their records were
    (the run writes each terminal state to its own folder)."""
    folder = tmp_path / "drop"
    folder.mkdir()
    prompts = [f"{'shared preamble ' * (i % 3)}question {i:03d}" for i in range(120)]
    pq.write_table(pa.table({"prompt": prompts, "n": pa.array(range(120), pa.int32())}), folder / "q.parquet")
    judge = {"kind": "rule", "callable": "min_length", "kwargs": {"min_chars": 20, "field": "prompt"}}  # every third rejected
    spec = make_spec(tmp_path, input=str(folder), infer={"sampling": {"max_tokens": 2}}, judge=judge, max_rounds=1)
    await run_pipeline(spec)
    out = pq.read_table(export_parquet(PipelineRun(spec)).out_url)
    assert out["n"].to_pylist() == list(range(120))
    assert _run_of(out, "status") == ["exhausted" if i % 3 == 0 else "approved" for i in range(120)]
    assert set(_run_of(out, "finish_reason")) == {"length"}
    assert set(_run_of(out, "completion_tokens")) == {2} and min(_run_of(out, "prompt_tokens")) > 0
    assert set(_run_of(out, "cached")) <= {None, False, True}
