"""Smoke test: bench/pool_round.py runs end to end at a tiny size (figures are not asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # runs the bench script as a child process

BENCH = Path(__file__).resolve().parents[2] / "bench" / "pool_round.py"


def test_pool_round_bench_runs_at_a_tiny_size() -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--shards", "2", "--records", "300", "--no-report", "--no-model-load"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Min / mean efficiency" in out.stdout
    assert "model loads 2 vs 2" in out.stdout  # pool: one per worker; naive: one per shard
    assert "600 records" in out.stdout
