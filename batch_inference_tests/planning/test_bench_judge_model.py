"""bench/judge_model.py runs end to end at a tiny scale: both placements, measured beside the plan."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # runs the bench script as a child process

ROOT = Path(__file__).resolve().parents[2]


def test_judge_model_bench_writes_its_report(tmp_path: Path) -> None:
    report = tmp_path / "judge_model.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "judge_model.py"), "--records", "60", "--shard-records", "20",
                           "--strategies", "in_place", "--a-ms", "1", "--b-us", "10", "--report", str(report)],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = report.read_text()
    assert "| in_place | infer engine |" in text and "| in_place | own pool |" in text
    assert "loaded once per pool for the whole run in every row" in text
