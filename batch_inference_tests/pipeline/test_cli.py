"""`batch-inference run SPEC` and `batch-inference status RUN`: exit codes, ledger table, Ctrl-C + resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from click.testing import CliRunner

from batch_inference.cli.pipeline_cmds import run, status
from batch_inference_tests.pipeline.conftest import spec_dict


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
    for column in ("in", "approved", "rejected", "failed", "funnel", "tokens in/out", "engine s", "wall s", "fill", "next"):
        assert f" {column} " in header, header
    assert any("round 1" in line and "exhausted" in line for line in proc.stdout.splitlines()), proc.stdout
