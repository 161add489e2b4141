"""Engine and judge faults: whole-batch exceptions now and then, one record that always
fails, a judge that never approves. Each ends in a full conservation check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from batch_inference.pipeline import RunLayout, run_pipeline
from batch_inference.storage import JsonlDir
from batch_inference_tests.faults.helpers import assert_conserved, make_spec, terminal_states, write_input


def _engine(**options: Any) -> dict[str, Any]:
    return {"kind": "simulated", "simulated": {"approval_rate": 0.7, "latency_a_s": 0.0005, "latency_b_s": 0.0, **options}}


@pytest.mark.parametrize("strategy", ["rounds", "in_place", "hybrid"])
async def test_engine_raising_for_a_whole_batch_now_and_then(tmp_path: Path, strategy: str) -> None:
    """Every 5th engine call raises: those records are retried (next round / next attempt), none lost."""
    ids = write_input(tmp_path / "input.jsonl", 300)
    spec = make_spec(tmp_path, strategy=strategy, engine=_engine(fail_batch_every=5), max_rounds=6, max_attempts=8,
                     pool={"batcher": {"batch_timeout_s": 0.002, "max_batch_size": 16}})
    summary = await run_pipeline(spec)
    counts = assert_conserved(spec, ids)
    assert counts["failed"] == 0, "a transient batch failure must cost an attempt, never the record"
    assert summary.failed == 0 and summary.conservation["ok"]
    assert counts["approved"] > 250


@pytest.mark.parametrize("strategy", ["rounds", "in_place", "hybrid"])
async def test_record_that_always_fails_ends_failed_with_its_reason(tmp_path: Path, strategy: str) -> None:
    """One record's prompt always fails in the engine; it ends ``failed`` naming why; its
    batch neighbours (records of other shards in the same batches) are unaffected."""
    src = tmp_path / "input.jsonl"
    ids = write_input(src, 200)
    lines = src.read_bytes().splitlines()
    lines[57] = orjson.dumps({"id": "poison", "prompt": "this one is POISON"})
    ids[57] = "poison"
    src.write_bytes(b"\n".join(lines) + b"\n")
    spec = make_spec(tmp_path, strategy=strategy, engine=_engine(fail_on="POISON", approval_rate=1.0))
    summary = await run_pipeline(spec)
    counts = assert_conserved(spec, ids)
    assert counts == {"approved": 199, "failed": 1}, counts
    assert terminal_states(spec)["poison"] == ["failed"]
    assert summary.failed == 1 and summary.conservation["ok"]
    # one record failed, no shard was quarantined: the status says which (exit 5, not 4)
    assert summary.status == "records_failed" and summary.quarantined == 0
    row = _failed_row(spec, "poison")
    assert "simulated_error" in str(row), row
    if strategy != "in_place":  # round 0's batches mixed shards; only the poison row erred
        lay = RunLayout(spec.output, spec.run)
        errs = [r["id"] for r in JsonlDir(lay.inferred(0)).iter_records_sync() if r.get("error")]
        assert errs == ["poison"]


def _failed_row(spec: Any, rid: str) -> dict[str, Any]:
    root = Path(spec.output) / spec.run
    for path in root.rglob("*.jsonl*"):
        if "failed" in str(path.relative_to(root)) or "unfinished" in str(path):
            for row in JsonlDir(str(path.parent)).iter_records_sync():
                if row.get("id") == rid:
                    return row
    raise AssertionError(f"{rid} not found in a failed set under {root}")


@pytest.mark.parametrize("strategy", ["rounds", "in_place", "hybrid"])
async def test_judge_that_never_approves_stops_at_the_cap_and_reports_exhaustion(tmp_path: Path, strategy: str) -> None:
    ids = write_input(tmp_path / "input.jsonl", 120)
    spec = make_spec(tmp_path, strategy=strategy, engine=_engine(approval_rate=0.0), max_rounds=3, max_attempts=4)
    summary = await run_pipeline(spec)
    assert summary.status == "exhausted" and summary.approved == 0
    counts = assert_conserved(spec, ids)
    assert counts["approved"] == 0 and counts["failed"] == 0
    if strategy == "rounds":
        assert summary.rounds == 3 and counts["exhausted"] == 120
    else:  # every record used exactly max_attempts attempts
        assert counts["max_attempts"] == 120
        rows = list(JsonlDir(RunLayout(spec.output, spec.run).tail_unfinished).iter_records_sync())
        assert {r["attempts"] for r in rows} == {4}
