"""Bad input: each gets a clear error, or a quarantine entry naming file/line/id and reason
while the rest of the data goes on (and ends in a full conservation check)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import orjson
import pytest
import yaml
import zstandard

from batch_inference.pipeline import ConservationError, PipelineRun, PipelineSpec, RunLayout, SpecError, run_pipeline
from batch_inference.pipeline.inputs import InputError
from batch_inference.pipeline.preflight import preflight
from batch_inference.storage import CorruptShardError, JsonlDir, JsonlFile
from batch_inference_tests.faults.helpers import assert_conserved, make_spec, spec_data, terminal_states, write_input

CLI = [sys.executable, "-m", "batch_inference.cli.main"]


def _lines(ids: list[str]) -> list[bytes]:
    return [orjson.dumps({"id": rid, "prompt": f"question {rid}"}) for rid in ids]


async def test_malformed_and_non_utf8_lines_are_quarantined_the_rest_goes_on(tmp_path: Path) -> None:
    ids = [f"g{i:03d}" for i in range(100)]
    lines = _lines(ids)
    lines.insert(10, b'{"id": "broken", "prompt": ')  # line 11: truncated JSON
    lines.insert(40, b'{"id": "latin1", "prompt": "caf\xe9"}')  # line 41: not UTF-8
    lines.insert(70, b'["not", "an", "object"]')  # line 71
    src = tmp_path / "input.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    spec = make_spec(tmp_path, input=str(src))
    summary = await run_pipeline(spec)
    counts = assert_conserved(spec, ids)
    assert sum(counts.values()) == 100 and summary.records == 100
    entries = JsonlFile(RunLayout(spec.output, spec.run).input_quarantine).iter_records_sync()
    by_line = {e["line"]: e for e in entries}
    assert set(by_line) == {11, 41, 71}
    assert all(e["file"] == str(src) for e in by_line.values())
    assert "UTF-8" in by_line[41]["reason"] and "object" in by_line[71]["reason"]
    shard = orjson.loads((Path(spec.output) / spec.run / "ledger" / "shard.json").read_bytes())
    assert shard["malformed"] == 3


async def test_ids_assigned_after_a_blank_and_a_malformed_line_name_their_lines(tmp_path: Path) -> None:
    """An assigned id is its line's 0-based number, the quarantine's ``line`` its 1-based one:
    a blank line and a malformed line before a record shift neither (preflight, sharding)."""
    lines = [orjson.dumps({"prompt": f"question {i}"}) for i in range(8)]
    lines[2] = b""  # line 3: blank
    lines[5] = b'{"prompt": '  # line 6: malformed
    lines[7] = orjson.dumps({"prompt": "question 7", "sampling": {"n": 2}})  # line 8: its own error names its id
    src = tmp_path / "input.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    spec = make_spec(tmp_path, input=str(src), preflight_records=8)
    expected = {f"{n:012d}": f"question {n}" for n in (0, 1, 3, 4, 6, 7)}
    (error,) = preflight(spec).record_errors
    assert "record '000000000007'" in error, error
    summary = await run_pipeline(spec)
    assert summary.records == 6
    assert_conserved(spec, list(expected))
    assert terminal_states(spec)["000000000007"] == ["failed"]
    sharded = JsonlDir(RunLayout(spec.output, spec.run).sharded).iter_records_sync()
    assert {r["id"]: r["prompt"] for r in sharded} == expected
    (entry,) = JsonlFile(RunLayout(spec.output, spec.run).input_quarantine).iter_records_sync()
    assert entry["line"] == 6


async def test_truncated_zst_input_is_a_clear_error_naming_the_file(tmp_path: Path) -> None:
    src = tmp_path / "input.jsonl.zst"
    raw = zstandard.ZstdCompressor().compress(b"\n".join(_lines([f"t{i}" for i in range(2000)])) + b"\n")
    src.write_bytes(raw[: len(raw) // 2])
    spec = make_spec(tmp_path, input=str(src))
    with pytest.raises(CorruptShardError, match="truncated") as info:
        await run_pipeline(spec)
    assert str(src) in str(info.value)
    assert not JsonlDir(RunLayout(spec.output, spec.run).sharded).exists_sync() or not JsonlDir(
        RunLayout(spec.output, spec.run).sharded).manifest(), "no half-written sharded input"


async def test_shard_damaged_in_storage_is_quarantined_and_named(tmp_path: Path) -> None:
    """A committed shard truncated in storage afterwards: its task fails and the shard is
    quarantined with the reason, the other shards finish, and the final check refuses to
    call the run conserved, naming the damaged shard (its records cannot be read back)."""
    write_input(tmp_path / "input.jsonl", 200)
    spec = make_spec(tmp_path, engine={"kind": "simulated", "simulated": {"approval_rate": 1.0, "latency_a_s": 0.0, "latency_b_s": 0.0}})
    await PipelineRun(spec).shard()
    part = Path(RunLayout(spec.output, spec.run).sharded) / "part-00001.jsonl.zst"
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConservationError, match="unreadable") as info:
        await run_pipeline(spec)
    assert str(part) in str(info.value)
    (entry,) = [q for p in (Path(spec.output) / spec.run).glob("round-00/failed/*.jsonl") for q in JsonlFile(str(p)).iter_records_sync()]
    assert entry["shard"] == str(part) and "truncated" in entry["error"] and entry["records"] == 50
    approved = [r["id"] for r in JsonlDir(RunLayout(spec.output, spec.run).results).iter_records_sync()]
    assert len(approved) == len(set(approved)) == 150


async def test_records_missing_the_template_field_end_failed_naming_field_and_id(tmp_path: Path) -> None:
    ids = [f"m{i:03d}" for i in range(100)]
    rows = [{"id": rid, "prompt": f"q {rid}"} for rid in ids]
    rows[33] = {"id": "m033", "question": "no prompt field"}
    src = tmp_path / "input.jsonl"
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    for strategy in ("rounds", "in_place"):
        spec = make_spec(tmp_path, input=str(src), strategy=strategy, run=f"missing-{strategy}",
                         engine={"kind": "simulated", "simulated": {"approval_rate": 1.0, "latency_a_s": 0.0}})
        await run_pipeline(spec)
        counts = assert_conserved(spec, ids)
        assert counts == {"approved": 99, "failed": 1}
        row = _row(spec, "m033")
        assert "missing_field" in str(row.get("reason") or row.get("error")) and "prompt" in str(row)


def _row(spec: PipelineSpec, rid: str) -> dict:
    root = Path(spec.output) / spec.run
    for d in (*root.glob("round-*/failed-records"), root / "tail" / "unfinished"):
        if d.exists():
            for r in JsonlDir(str(d)).iter_records_sync():
                if r["id"] == rid:
                    return r
    raise AssertionError(rid)


@pytest.mark.slow
async def test_a_50_mb_single_record_fails_alone(tmp_path: Path) -> None:
    ids = [f"b{i:03d}" for i in range(60)]
    src = tmp_path / "input.jsonl"
    with open(src, "wb") as f:
        for rid in ids[:30]:
            f.write(orjson.dumps({"id": rid, "prompt": f"q {rid}"}) + b"\n")
        f.write(orjson.dumps({"id": "huge", "prompt": "x" * (50 << 20)}) + b"\n")
        for rid in ids[30:]:
            f.write(orjson.dumps({"id": rid, "prompt": f"q {rid}"}) + b"\n")
    spec = make_spec(tmp_path, input=str(src), engine={"kind": "simulated", "simulated": {"approval_rate": 1.0, "latency_a_s": 0.0}})
    summary = await run_pipeline(spec)
    counts = assert_conserved(spec, [*ids, "huge"])
    assert counts == {"approved": 60, "failed": 1} and summary.conservation["ok"]
    assert "prompt_too_long" in _row(spec, "huge")["reason"]


@pytest.mark.parametrize("strategy", ["rounds", "in_place"])
async def test_duplicate_ids_are_reported_and_each_copy_conserved(tmp_path: Path, strategy: str) -> None:
    ids = [f"d{i:03d}" for i in range(100)]
    src = tmp_path / "input.jsonl"
    src.write_bytes(b"\n".join(_lines(ids[:5]) + _lines(ids)) + b"\n")  # copies in the same shard
    spec = make_spec(tmp_path, input=str(src), strategy=strategy)
    summary = await run_pipeline(spec)
    shard = orjson.loads((Path(spec.output) / spec.run / "ledger" / "shard.json").read_bytes())
    assert shard["duplicate_ids"] == 5 and set(shard["duplicate_examples"]) == set(ids[:5])
    assert summary.conservation["ok"] and summary.records == 105
    states = terminal_states(spec)
    assert set(states) == set(ids)
    assert Counter(len(s) for s in states.values()) == {1: 95, 2: 5}  # each copy exactly once


async def test_empty_input_is_refused_unless_the_spec_allows_it(tmp_path: Path) -> None:
    """An input of no records is refused by validate and run (a wrong path, an export that
    wrote nothing); ``input: {url, allow_empty: true}`` runs it as an empty, converged run."""
    src = tmp_path / "input.jsonl"
    src.write_bytes(b"")
    empty_dir = tmp_path / "drop"
    empty_dir.mkdir()
    for where, what in ((src, "an empty file"), (empty_dir, "an empty folder")):
        spec = make_spec(tmp_path, input=str(where), run="refused")
        with pytest.raises(InputError, match=f"yields no records \\({what}\\).*allow_empty: true"):
            preflight(spec)
        with pytest.raises(InputError, match="yields no records"):
            await run_pipeline(spec)
        with pytest.raises(InputError, match="yields no records"):  # the Dagster shard step, without the preflight
            await PipelineRun(spec).shard()
        assert PipelineRun(spec).ledger.read(RunLayout.SHARD) is None
    for strategy in ("rounds", "in_place"):
        spec = make_spec(tmp_path, input={"url": str(src), "allow_empty": True}, strategy=strategy, run=f"empty-{strategy}")
        assert preflight(spec).checked_records == 0
        summary = await run_pipeline(spec)
        assert summary.records == 0 and summary.status == "converged" and summary.conservation["ok"]


def _csv_folder(tmp_path: Path, n: int = 3, *, beside_jsonl: bool = False) -> Path:
    folder = tmp_path / "csv"
    folder.mkdir()
    for i in range(n):
        (folder / f"part-{i}.csv").write_text("id,prompt\n" + "".join(f"{i}-{j},question {j}\n" for j in range(500)))
    (folder / "_SUCCESS").write_text("")  # metadata names (underscore, dot) are never data
    if beside_jsonl:
        write_input(folder / "part-9.jsonl", 5)
    return folder


@pytest.mark.parametrize("shape", ["folder", "file", "mixed"])
async def test_input_of_no_known_format_is_refused_naming_what_was_found(tmp_path: Path, shape: str) -> None:
    """A folder of CSV files, a single CSV file, or CSV files beside JSONL shards: refused by
    validate, run and the shard step, naming the files, never run as an empty (or partial) run."""
    folder = _csv_folder(tmp_path, beside_jsonl=shape == "mixed")
    src = folder / "part-0.csv" if shape == "file" else folder
    expected = {"folder": "3 files \\*.csv: not a format this input reads",
                "mixed": "3 files \\*.csv: not a format this input reads beside 1 it reads",
                "file": "part-0.csv yields no records: 501 line\\(s\\), none of them a JSON object: not a format this input reads"}[shape]
    spec = make_spec(tmp_path, input={"url": str(src), "allow_empty": True})  # allowing empty input does not allow these
    with pytest.raises(InputError, match=expected):
        preflight(spec)
    with pytest.raises(InputError, match=expected):
        await run_pipeline(spec)
    with pytest.raises(InputError, match=expected):
        await PipelineRun(spec).shard()
    assert PipelineRun(spec).ledger.read(RunLayout.SHARD) is None


def test_validate_and_inspect_exit_non_zero_on_a_folder_of_no_known_format(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from batch_inference.cli.pipeline_cmds import validate
    from batch_inference.cli.storage_cmds import inspect

    folder = _csv_folder(tmp_path)
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec_data(tmp_path, input=str(folder))))
    checked = CliRunner().invoke(validate, [str(spec_path)], terminal_width=200)
    assert checked.exit_code == 1 and "3 files *.csv: not a format this input reads" in checked.output, checked.output
    assert "can run" not in checked.output
    shown = CliRunner().invoke(inspect, [str(folder)], terminal_width=200)
    assert shown.exit_code == 1 and "3 files *.csv" in shown.output, shown.output
    one = CliRunner().invoke(inspect, [str(folder / "part-1.csv")], terminal_width=200)
    assert one.exit_code == 1 and "none of them a JSON object" in one.output, one.output


@pytest.mark.process
def test_missing_input_url_is_a_clear_cli_error(tmp_path: Path) -> None:
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec_data(tmp_path, input=str(tmp_path / "nope.jsonl"))))
    res = subprocess.run([*CLI, "run", str(spec_path)], capture_output=True, timeout=60)
    out = (res.stdout + res.stderr).decode()
    assert res.returncode == 1 and "nope.jsonl" in out and "Traceback" not in out, out


@pytest.mark.process
def test_spec_with_unknown_keys_and_wrong_types_names_every_key(tmp_path: Path) -> None:
    data = spec_data(tmp_path)
    data["max_roundz"] = 3
    data["pool"]["replicas"] = "many"
    data["chunk_size"] = -1
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError) as info:
        PipelineSpec.load(spec_path)
    msg = str(info.value)
    assert str(spec_path) in msg and "max_roundz: unknown key" in msg and "pool.replicas" in msg and "chunk_size" in msg
    res = subprocess.run([*CLI, "run", str(spec_path)], capture_output=True, timeout=60)
    out = (res.stdout + res.stderr).decode()
    assert res.returncode != 0 and "max_roundz" in out and "Traceback" not in out
