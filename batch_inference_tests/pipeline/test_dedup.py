"""Identical requests computed once, end to end: the same rows and terminal states with it on or off.

Seeded random workloads with many exact repeats, a mix of greedy and sampled records
(per-record sampling overrides), failing prompts and every strategy run twice, dedup on
and off, on the simulated engine with ``greedy: prompt`` (greedy output depends on the
prompt alone, as a real engine's).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import orjson
import pytest

from batch_inference.pipeline import PipelineRun, PipelineSpec, run_pipeline
from batch_inference.storage import JsonlDir
from batch_inference_tests.pipeline.helpers import spec_dict


def _workload(path: Path, seed: int, n: int) -> None:
    rng = random.Random(seed)
    questions = [f"question {i} {'poison' if i % 7 == 3 else 'plain'}" for i in range(max(3, n // 6))]
    samplings: list[dict[str, Any] | None] = [None, None, None, {"temperature": 0.8}, {"max_tokens": 5},
                                             {"temperature": 0.0, "seed": 4}]
    with open(path, "wb") as f:
        for _ in range(n):
            rec: dict[str, Any] = {"prompt": rng.choice(questions)}
            if (s := rng.choice(samplings)) is not None:
                rec["sampling"] = s
            f.write(orjson.dumps(rec) + b"\n")


def _terminal_rows(spec: PipelineSpec) -> dict[str, tuple[str, dict[str, Any]]]:
    rows: dict[str, tuple[str, dict[str, Any]]] = {}
    for source in PipelineRun(spec).terminal_sources():
        if source.state == "input" or not source.is_dir:
            continue
        for url in source.urls:
            d = JsonlDir(url)
            if d.exists_sync():
                for row in d.iter_records_sync():
                    assert row["id"] not in rows, f"{row['id']} in two terminal states"
                    rows[row["id"]] = (source.state, row)
    return rows


@pytest.mark.parametrize("strategy,seed", [("rounds", 1), ("rounds", 2), ("in_place", 3), ("hybrid", 4)])
async def test_rows_and_terminal_states_are_the_same_with_dedup_on_and_off(tmp_path: Path, strategy: str, seed: int) -> None:
    src = tmp_path / "input.jsonl"
    _workload(src, seed, 240)
    outcomes = {}
    for dedup in (True, False):
        # the cross-run result cache off: it also answers repeats across shards and rounds of
        # one run (rows then say ``cached``); this compares the in-run memo alone
        data = spec_dict(tmp_path, strategy=strategy, dedup=dedup, output=str(tmp_path / f"out-{dedup}"), cache={"enabled": False},
                         shard_records=60, chunk_size=25, max_rounds=3, max_attempts=4,
                         engine={"simulated": {"approval_rate": 0.5, "greedy": "prompt", "fail_on": "poison"}})
        data["infer"]["sampling"] = {"max_tokens": 8, "temperature": 0.0, "seed": 7}
        spec = PipelineSpec.parse(data)
        summary = await run_pipeline(spec)
        assert summary.conservation["ok"]
        view = PipelineRun(spec).ledger.view()
        phases = [p for r in view.rounds for p in r.phases] + ([view.tail] if view.tail else [])
        outcomes[dedup] = (summary, _terminal_rows(spec), sum(p.duplicates for p in phases))
    (on, rows_on, saved), (off, rows_off, none) = outcomes[True], outcomes[False]
    assert saved > 0 and none == 0  # the repeats were computed once ...
    assert len(rows_on) == 240 and rows_on == rows_off  # ... and every record ended as it would have
    assert (on.status, on.approved, on.exhausted, on.max_attempts, on.failed) == (
        off.status, off.approved, off.exhausted, off.max_attempts, off.failed)
    assert (on.tokens_in, on.tokens_out) == (off.tokens_in, off.tokens_out)
