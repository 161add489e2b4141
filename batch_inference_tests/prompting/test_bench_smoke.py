"""bench/openai_batch_shard.py runs end to end at a tiny scale (figures not asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # runs the bench script as a child process

ROOT = Path(__file__).resolve().parents[2]


def test_openai_batch_shard_bench_writes_its_report(tmp_path: Path) -> None:
    report = tmp_path / "openai_batch_shard.md"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "openai_batch_shard.py"), "--records", "2000", "--out", str(report)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "OpenAI Batch / native throughput" in report.read_text() and "2,000 records -> 1 shards" in proc.stdout
