"""bench/batch_api.py: the report of whichever paths ran, and the run's phases from its ledger."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
batch_api = pytest.importorskip("batch_api")

RAW = {"seconds": 7.0, "load_s": 20.0, "requests": 5000, "prompt_tokens": 100, "output_tokens": 40, "load": [1.0, 1.1]}
API = {"seconds": 8.0, "run_wall_s": 7.5, "warmup_s": 30.0, "upload_s": 0.05, "to_completed_s": 7.8, "download_s": 0.1,
       "validating_s": 0, "in_progress_s": 8, "finalizing_s": 0, "requests": 5000, "prompt_tokens": 100, "output_tokens": 40,
       "load": [1.0, 1.2], "phases": {"shard_s": 0.1, "infer_s": 7.2, "engine_busy_s": 7.1, "longest_task_s": 7.2, "rest_s": 0.2}}


def args(order: str) -> argparse.Namespace:
    return argparse.Namespace(records=5000, output=8, poll_s=0.5, order=order)


def test_report_of_raw_and_api_alone_gives_their_ratios_and_phases() -> None:
    text = batch_api.report(args("raw,api"), [{"order": "raw,api", "raw": RAW, "api": API}], 60.0, 1.0, 1.2)
    assert "API pipeline run wall / raw generate | 1.07 |" in text
    assert "CLI" not in text.split("Ratios")[1]  # no ratio needs a path that did not run
    assert "shard step 0.10 s, inference 7.20 s" in text
    assert "agree on every path" in text


def test_report_of_all_three_paths_keeps_the_cli_ratios() -> None:
    cli = {"seconds": 60.0, "run_wall_s": 15.0, "requests": 5000, "output_lines": 5000, "prompt_tokens": 100,
           "output_tokens": 40, "load": [1.0, 2.0]}
    text = batch_api.report(args("raw,api,cli"), [{"order": "raw,api,cli", "raw": RAW, "api": API, "cli": cli}], 90.0, 1.0, 2.0)
    assert "CLI run wall / raw generate | 2.14 |" in text and "API run wall / CLI run wall" in text


def test_run_phases_reads_the_shard_step_and_the_tail_from_the_ledger(tmp_path: Path) -> None:
    ledger = tmp_path / "b1" / "ledger"
    ledger.mkdir(parents=True)
    (ledger / "run.json").write_text(json.dumps({"wall_s": 10.0}))
    (ledger / "shard.json").write_text(json.dumps({"wall_s": 1.0}))
    (ledger / "tail.json").write_text(json.dumps({"wall_s": 8.5, "engine_busy_s": 8.0, "longest_task_s": 8.4}))
    got = batch_api.run_phases(tmp_path, "b1")
    assert got == {"shard_s": 1.0, "infer_s": 8.5, "engine_busy_s": 8.0, "longest_task_s": 8.4, "rest_s": pytest.approx(0.5)}


def test_report_with_raw_chat_gives_the_api_against_llm_chat() -> None:
    """``raw_chat`` (LLM.chat: the chat template inside its timer) beside the pre-rendered raw path."""
    chat = {**RAW, "seconds": 7.5, "cpu_s": {"front": 1.5, "engine": 12.0}}
    text = batch_api.report(args("raw,raw_chat,api"), [{"order": "raw,raw_chat,api", "raw": RAW, "raw_chat": chat, "api": API}],
                            60.0, 1.0, 1.2)
    assert "API pipeline run wall / raw `LLM.chat` (the chat template inside its timer) | 1.00 |" in text
    assert "raw `LLM.chat` / raw generate of pre-rendered ids | 1.07 |" in text
    assert "raw LLM.chat CPU: front end 1.50 s" in text and "agree on every path" in text


@pytest.mark.process
def test_busy_beside_takes_its_share_of_a_core_and_stops_with_the_bench() -> None:
    import time

    import psutil

    with batch_api.busy_beside(0.5) as proc:
        assert proc is not None
        child = psutil.Process(proc.pid)
        time.sleep(0.2)
        before = sum(child.cpu_times()[:2])
        time.sleep(1.0)
        share = sum(child.cpu_times()[:2]) - before
    assert 0.05 < share < 0.8, share  # busy, and not a whole core (a loaded CI machine gives it less than half)
    assert proc.poll() is not None  # stopped with the bench
    with batch_api.busy_beside(0.0) as none:
        assert none is None
