"""Strategy 2 (in-place retry): statuses, attempts, and resume after a real SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
import yaml

from batch_inference.pipeline import PipelineSpec, run_pipeline
from batch_inference.storage import CheckpointStore, JsonlDir
from batch_inference_tests.pipeline.helpers import spec_dict


def rows_by_id(spec: PipelineSpec) -> dict[str, dict]:
    root = Path(spec.output) / spec.run
    rows = {}
    for d in ("results", "tail/unfinished"):
        if (root / d).exists():
            for r in JsonlDir(str(root / d)).iter_records_sync():
                assert r["id"] not in rows, f"{r['id']} twice"
                rows[r["id"]] = r
    return rows


async def test_in_place_statuses_and_attempts(make_spec) -> None:
    spec = make_spec(strategy="in_place", approval=0.4, max_attempts=3)
    summary = await run_pipeline(spec)
    assert summary.tail and summary.rounds == 0
    assert summary.status == "exhausted"  # some records used all 3 attempts
    assert summary.approved + summary.max_attempts == 600 and summary.failed == 0
    assert summary.conservation["ok"]
    rows = rows_by_id(spec)
    assert len(rows) == 600
    assert {r["status"] for r in rows.values()} == {"approved", "max_attempts"}
    assert all(1 <= r["attempts"] <= 3 for r in rows.values())
    assert all(r["attempts"] == 3 for r in rows.values() if r["status"] == "max_attempts")
    # ~0.4 + 0.24 + 0.144 = 78% approved within 3 attempts
    assert 0.65 < summary.approved / 600 < 0.9


async def test_an_approved_in_place_row_carries_its_attempts_usage_as_a_rounds_row_does(make_spec) -> None:
    """The approved row's usage and finish_reason are the approved attempt's (the API's output
    lines report them): the same as the rounds path's row of the same record and attempt."""
    in_place = make_spec(run="in-place", strategy="in_place", approval=0.4, max_attempts=3)
    rounds = make_spec(run="rounds", strategy="rounds", approval=0.4, max_rounds=3)
    await run_pipeline(in_place)
    await run_pipeline(rounds)
    got, want = rows_by_id(in_place), rows_by_id(rounds)
    approved = [k for k, v in got.items() if v["status"] == "approved"]
    assert len(approved) > 300
    compared = 0
    for rid in approved:
        row = got[rid]
        assert row["usage"]["prompt_tokens"] > 0 and row["usage"]["completion_tokens"] == len(row["result"].split()), row
        assert row["finish_reason"] in ("stop", "length")
        same = want[rid]
        if same["status"] == "approved" and same["attempts"] == row["attempts"]:
            assert (row["usage"], row["finish_reason"]) == (same["usage"], same["finish_reason"]), rid
            compared += 1
    assert compared > 200


def _segments_by_time(store: CheckpointStore, before_ns: int) -> tuple[list[dict], list[dict]]:
    old, new = [], []
    for seg in store.segments():
        stamp = int(seg.name.split("-")[1])
        (old if stamp < before_ns else new).extend(seg.iter_records_sync())
    return old, new


@pytest.mark.process
def test_in_place_resumes_each_sample_at_its_attempt_after_sigkill(tmp_path: Path) -> None:
    """The process running the worker's task code is SIGKILLed mid-tail; the re-run resumes."""
    data = spec_dict(
        tmp_path, records=300, strategy="in_place", max_attempts=6, shard_records=150, chunk_size=150,
        engine={"kind": "simulated", "simulated": {"approval_rate": 0.25, "latency_a_s": 0.06, "latency_b_s": 0.0}},
        pool={"concurrency": 2, "checkpoint_interval_s": 0.1, "batcher": {"batch_timeout_s": 0.002}},
    )
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(data))
    spec = PipelineSpec.load(spec_path)
    root = Path(spec.output) / spec.run
    store = CheckpointStore(str(root / "tail" / "checkpoints" / "part-00000"))
    code = (
        "import sys; from batch_inference.pipeline import PipelineSpec, run_step; "
        "s = PipelineSpec.load(sys.argv[1]); run_step(s, 'shard'); run_step(s, 'tail', 0)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(spec_path)], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # wait until some samples are past attempt 2
            states = store.load_sync()
            if any(s.get("attempt", 0) >= 2 for s in states.values()):
                break
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.02)
        else:
            raise AssertionError("no checkpoint reached attempt 2")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    killed_at = time.time_ns()
    assert proc.returncode == -signal.SIGKILL
    assert not (root / "tail" / "output" / "part-00000.jsonl.zst").exists()  # nothing half-written visible
    at_kill = store.load_sync()

    import asyncio

    summary = asyncio.run(run_pipeline(spec))
    assert summary.conservation["ok"] and summary.approved + summary.max_attempts == 300

    # Every sample checkpointed at the kill resumed at (never before) the attempt it was on.
    _, after = _segments_by_time(store, killed_at)
    first_after: dict[str, dict] = {}
    for s in after:
        first_after.setdefault(s["id"], s)
    resumed = 0
    for rid, state in at_kill.items():
        if "final" in state:
            assert rid not in first_after or first_after[rid].get("final") == state["final"]
            continue
        nxt = first_after[rid]
        assert nxt["attempt"] >= state["attempt"], f"{rid}: killed at attempt {state['attempt']}, resumed at {nxt['attempt']}"
        resumed += state["attempt"] > 0
    assert resumed > 0

    # The outcome equals an uninterrupted run's (seeds are per record and attempt) ...
    clean = PipelineSpec.parse({**data, "run": "clean"})
    clean_summary = asyncio.run(run_pipeline(clean))
    got, want = rows_by_id(spec), rows_by_id(clean)
    assert {k: (v["status"], v["attempts"]) for k, v in got.items()} == {k: (v["status"], v["attempts"]) for k, v in want.items()}
    # an approved row resumed from its checkpoint carries its attempt's usage, as one never interrupted
    assert {k: (v.get("usage"), v.get("finish_reason")) for k, v in got.items() if v["status"] == "approved"} == \
        {k: (v["usage"], v["finish_reason"]) for k, v in want.items() if v["status"] == "approved"}
    # ... with less engine work after the kill: finished attempts were not redone.
    assert summary.tokens_in < clean_summary.tokens_in


async def test_a_quarantined_tail_shard_names_its_real_task_id(make_spec) -> None:
    """The tail's tasks are ``<run>/<instance>/rNN/retry/i``: its quarantine entry says so (not ``tail``)."""
    from batch_inference.pipeline.runner import open_runner
    from batch_inference_tests.pipeline.helpers import FailingShardRunner

    spec = make_spec(strategy="in_place", approval=0.9, max_attempts=3)
    async with open_runner(spec) as pool:
        runner = FailingShardRunner(pool, shard_name="sharded/part-00002.jsonl.zst", kind="retry")
        summary = await run_pipeline(spec, runner=runner)
    (entry,) = [q for q in orjson.loads((Path(spec.output) / spec.run / "ledger" / "tail.json").read_bytes())["quarantined"]]
    instance = orjson.loads((Path(spec.output) / spec.run / "ledger" / "shard.json").read_bytes())["instance"]
    assert entry["task_id"] == f"{spec.run}/{instance}/r00/retry/00002" and instance
    assert summary.status == "quarantined" and summary.quarantined == summary.failed == 100
