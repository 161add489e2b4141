"""bench/batcher.py runs end to end without flyte (a tiny scale; figures not asserted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # runs the bench script as a child process

ROOT = Path(__file__).resolve().parents[2]


def test_bench_runs_without_flyte_and_writes_report(tmp_path: Path) -> None:
    report = tmp_path / "batcher.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "batcher.py"), "--scale", "0.005", "--repeats", "1",
         "--no-flyte", "--gpu", "thread", "--report", str(report)],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    text = report.read_text()
    assert "ours DynamicBatcher" in text and "ours TokenBatcher strict_budget" in text
    assert "floor asyncio.Queue" in text
