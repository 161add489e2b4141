"""`batch-inference run SPEC` and `batch-inference status RUN`: exit codes, ledger table, Ctrl-C + resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from batch_inference.cli.pipeline_cmds import run, status
from batch_inference_tests.pipeline.helpers import spec_dict


def test_run_then_status(tmp_path: Path) -> None:
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec_dict(tmp_path, approval=0.3, max_rounds=2)))
    result = CliRunner().invoke(run, [str(spec_path)], terminal_width=160)
    assert result.exit_code == 3, result.output  # exhaustion is not success
    assert "status: exhausted" in result.output and "conservation: OK" in result.output
    assert "round 1 -> exhausted: max_rounds (2) reached" in result.output
    shown = CliRunner().invoke(status, [str(tmp_path / "out" / "test-run")], terminal_width=160)
    assert shown.exit_code == 0, shown.output
    assert "round 0" in shown.output and "round 1" in shown.output and "exhausted" in shown.output
    as_json = CliRunner().invoke(status, [str(spec_path), "--json"])
    assert as_json.exit_code == 0 and '"rounds"' in as_json.output


def test_run_strategy_override_and_converged_exit(tmp_path: Path) -> None:
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec_dict(tmp_path, approval=1.0)))
    result = CliRunner().invoke(run, [str(spec_path), "--strategy", "in_place", "--run-name", "other"], terminal_width=160)
    assert result.exit_code == 0, result.output
    assert "status: converged" in result.output and (tmp_path / "out" / "other" / "tail").is_dir()


def test_bad_spec_and_unknown_run(tmp_path: Path) -> None:
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump({**spec_dict(tmp_path), "shards": 3}))
    result = CliRunner().invoke(run, [str(spec_path)])
    assert result.exit_code == 1 and "shards: unknown key" in result.output
    missing = CliRunner().invoke(status, [str(tmp_path / "nowhere" / "run")])
    assert missing.exit_code == 1 and "no ledger" in missing.output


@pytest.mark.process
def test_ctrl_c_stops_cleanly_and_rerun_resumes(tmp_path: Path) -> None:
    data = spec_dict(
        tmp_path, records=2000, approval=0.5, max_rounds=2, pool={"concurrency": 2},
        engine={"kind": "simulated", "simulated": {"approval_rate": 0.5, "latency_a_s": 0.01, "latency_b_s": 0.0001}},
    )
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(data))
    progress = tmp_path / "out" / "test-run" / "ledger" / "progress" / "round-00-infer"
    cmd = [sys.executable, "-m", "batch_inference.cli.main", "run", str(spec_path)]
    # A user's Ctrl-C reaches a process whose SIGINT is at its default; a test run started in
    # the background of a non-interactive shell inherits SIGINT ignored (Python then installs
    # no KeyboardInterrupt handler), so restore the default as a terminal would have it.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not (progress.exists() and len(list(progress.iterdir())) >= 2):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out
    assert "interrupted" in out
    # tasks still running at Ctrl-C are drained before the engine closes: no traceback
    assert "Traceback" not in out and "is stopped" not in out, out
    done = len(list(progress.iterdir()))
    assert done < 20
    again = CliRunner().invoke(run, [str(spec_path)], terminal_width=160)
    assert again.exit_code == 3, again.output
    assert "conservation: OK" in again.output


@pytest.mark.process
def test_the_ledger_table_is_readable_off_a_terminal(tmp_path: Path) -> None:
    """``batch-inference status RUN | cat``: stdout is a pipe; every header stays whole."""
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec_dict(tmp_path, records=200, approval=0.5, max_rounds=2)))
    assert CliRunner().invoke(run, [str(spec_path)]).exit_code == 3
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    proc = subprocess.run([sys.executable, "-m", "batch_inference.cli.main", "status", str(spec_path)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout
    header = next(line for line in proc.stdout.splitlines() if "phase" in line)
    for column in ("in", "approved", "rejected", "failed", "funnel", "tokens in/out", "engine", "wall", "fill", "next"):
        assert f" {column} " in header, header
    assert any("round 1" in line and "exhausted" in line for line in proc.stdout.splitlines()), proc.stdout


@pytest.mark.process
def test_status_fits_80_and_60_columns_without_cutting_a_value(tmp_path: Path) -> None:
    """``COLUMNS=80`` / ``60 batch-inference status RUN``: columns are left out in the stated
    order (named under the table), or each row is stacked; every header and value that is
    shown is whole (never cut to ``…``) and no line is wider than the terminal."""
    from batch_inference.pipeline import Ledger, RunLayout
    from batch_inference.pipeline.report import LEAVE_OUT_ORDER, ledger_table

    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec_dict(tmp_path, records=200, approval=0.5, max_rounds=2)))
    assert CliRunner().invoke(run, [str(spec_path)]).exit_code == 3
    rows = ledger_table(Ledger(RunLayout(str(tmp_path / "out"), "test-run")).view(), "t").rows
    assert [r["phase"] for r in rows] == ["input", "shard", "round 0", "round 1"]  # the funnel starts from the input's lines
    for width in (80, 60):
        env = {**os.environ, "COLUMNS": str(width)}
        proc = subprocess.run([sys.executable, "-m", "batch_inference.cli.main", "status", str(spec_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout
        out = proc.stdout
        assert "…" not in out, out
        assert max(len(line) for line in out.splitlines()) <= width, out
        if width == 80:  # a table: what is left out is said, the rest is whole
            header = next(line for line in out.splitlines() if "phase" in line and "approved" in line)
            left_out = next(line for line in out.splitlines() if "left out at this width" in line)
            for name in ("phase", "in", "approved", "rejected", "failed", "funnel", "wall", "next"):
                assert f" {name} " in header, header
            for name in ("fill", "out tok/s", "engine", "tokens in/out"):
                assert name not in header and name in left_out, out
            assert all(name in LEAVE_OUT_ORDER for name in ("fill", "out tok/s", "engine", "tokens in/out"))
            for row in rows:
                line = next(line for line in out.splitlines() if line.startswith(f"│ {row['phase']} "))
                cells = [c.strip() for c in line.strip("│").split("│")]
                assert cells[:5] == [row.get(k, "") for k in ("phase", "in", "approved", "rejected", "failed")], line
                assert row["wall"] in cells and (row.get("next") or row.get("note")) in cells, line
        else:  # stacked: each row's block names each figure beside its value
            blocks = out.split("\n" + "round ")
            for row in [r for r in rows if r["phase"].startswith("round ")]:
                block = next(b for b in blocks if b.startswith(row["phase"].removeprefix("round ") + " -> "))
                for name in ("in", "approved", "rejected", "failed", "funnel", "tokens in/out", "engine", "wall", "fill"):
                    assert f"{name} {row[name]}" in block, (name, block)
