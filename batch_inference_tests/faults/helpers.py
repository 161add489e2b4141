"""Fault-suite helpers: small specs on the simulated engine and an independent conservation check.

Every fault test ends in :func:`assert_conserved`, which does NOT trust the pipeline's
own ledger: it reads the input ids the test wrote and every terminal row the run left
(results, exhausted, tail/unfinished, quarantined shards) and checks that each input id
is in exactly one terminal state and that results hold no id twice.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import yaml
from batch_inference.pipeline import PipelineSpec, RunLayout
from batch_inference.storage import JsonlDir, JsonlFile

FAST_ENGINE: dict[str, Any] = {"kind": "simulated", "simulated": {"approval_rate": 0.6, "latency_a_s": 0.0005, "latency_b_s": 0.0}}


def write_input(path: Path, n: int, *, prefix: str = "q") -> list[str]:
    """``n`` records ``{"id", "prompt"}`` as plain JSONL; returns their ids."""
    ids = [f"{prefix}{i:05d}" for i in range(n)]
    with open(path, "wb") as f:
        for rid in ids:
            f.write(orjson.dumps({"id": rid, "prompt": f"question {rid}"}) + b"\n")
    return ids


def spec_data(tmp_path: Path, *, input: str | None = None, records: int = 400, **overrides: Any) -> dict[str, Any]:
    """A spec mapping: simulated engine, 50-record shards, in-process pool (override anything)."""
    if input is None:
        src = tmp_path / "input.jsonl"
        if not src.exists():
            write_input(src, records)
        input = str(src)
    data: dict[str, Any] = {
        "run": "faults",
        "input": input,
        "output": str(tmp_path / "out"),
        "engine": FAST_ENGINE,
        "infer": {"template": "Answer: {prompt}", "sampling": {"max_tokens": 8, "seed": 7}},
        "judge": {"kind": "llm", "template": "Judge: {result}"},
        "strategy": "rounds",
        "max_rounds": 4,
        "max_attempts": 6,
        "shard_records": 50,
        "chunk_size": 25,
        "pool": {"concurrency": 4, "retries": 2, "batcher": {"batch_timeout_s": 0.002}},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict) and key != "engine":
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return data


def make_spec(tmp_path: Path, **overrides: Any) -> PipelineSpec:
    return PipelineSpec.parse(spec_data(tmp_path, **overrides))


RULE_JUDGE: dict[str, Any] = {"kind": "rule", "callable": "regex", "kwargs": {"pattern": "^APPROVED"}}


@dataclass(frozen=True)
class SpotKill:
    """A run written to be SIGKILLed mid-round: its input ids, its spec (written at
    ``spec_path``), its output root and round 0's infer progress folder."""

    ids: list[str]
    spec_path: Path
    spec: PipelineSpec
    root: Path
    progress: Path
    shards: int  # round 0's infer shards


def spot_kill_run(tmp_path: Path, *, run: str = "faults", **overrides: Any) -> SpotKill:
    """400 records in 8 shards of 50, two in flight, on a simulated engine that takes 30 ms a
    call: slow enough that a kill after the first few progress records lands mid-round, with
    shards still in flight. ``overrides`` go to ``spec_data`` (e.g. ``judge=RULE_JUDGE``)."""
    records, shard_records = 400, 50
    ids = write_input(tmp_path / "input.jsonl", records)
    data = spec_data(
        tmp_path, run=run, shard_records=shard_records, chunk_size=25,
        engine={"kind": "simulated", "simulated": {"approval_rate": 0.6, "latency_a_s": 0.03, "latency_b_s": 0.0}},
        pool={"concurrency": 2, "retries": 1, "batcher": {"batch_timeout_s": 0.002}},
        **overrides,
    )
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(data))
    spec = PipelineSpec.load(spec_path)
    root = Path(spec.output) / spec.run
    return SpotKill(ids, spec_path, spec, root, root / "ledger" / "progress" / "round-00-infer", records // shard_records)


def terminal_states(spec: PipelineSpec) -> dict[str, list[str]]:
    """id -> every terminal state it was found in, read straight from storage.

    Terminal sets: results (approved), exhausted, tail/unfinished (max_attempts or
    error = failed), round-NN/failed-records (permanent per-record errors), and the
    records of every quarantined shard (failed).
    """
    opts = spec.storage_options or None
    lay = RunLayout(spec.output, spec.run)
    found: dict[str, list[str]] = {}

    def add(rows: Any, state: str | None) -> None:
        for row in rows:
            s = state or ("max_attempts" if row.get("status") == "max_attempts" else "failed")
            found.setdefault(str(row["id"]), []).append(s)

    dirs = [(lay.results, "approved"), (lay.exhausted, "exhausted"), (lay.tail_unfinished, None)]
    r = 0
    while JsonlDir(lay.round_dir(r), storage_options=opts).exists_sync():
        dirs.append((lay.failed_records(r), "failed"))
        r += 1
    for url, state in dirs:
        d = JsonlDir(url, storage_options=opts)
        if d.exists_sync() and d.shards():
            add(d.iter_records_sync(), state)
    for entry in quarantine_entries(spec):
        add(JsonlFile(entry["shard"], storage_options=opts).iter_records_sync(), "failed")
    return found


def quarantine_entries(spec: PipelineSpec) -> list[dict[str, Any]]:
    """Every quarantined-shard entry (round-NN/failed/*, tail/failed/*) the run wrote."""
    opts = spec.storage_options or None
    lay = RunLayout(spec.output, spec.run)
    fs = JsonlDir(lay.root, storage_options=opts).fs
    root = JsonlDir(lay.root, storage_options=opts).path
    fs.invalidate_cache()
    entries = []
    for path in sorted(fs.glob(f"{root}/round-*/failed/*.jsonl") + fs.glob(f"{root}/tail/failed/*.jsonl")):
        entries.extend(JsonlFile(f"{lay.root}{path[len(root):]}", storage_options=opts).iter_records_sync())
    return entries


def assert_conserved(spec: PipelineSpec, input_ids: list[str]) -> Counter[str]:
    """Every input id in exactly one terminal state, no id twice in results; returns state counts."""
    found = terminal_states(spec)
    missing = [i for i in input_ids if i not in found]
    twice = {i: s for i, s in found.items() if len(s) > 1}
    extra = sorted(set(found) - set(input_ids))
    assert not missing, f"{len(missing)} record(s) lost, e.g. {missing[:5]}"
    assert not twice, f"{len(twice)} record(s) in more than one terminal row, e.g. {list(twice.items())[:5]}"
    assert not extra, f"{len(extra)} unknown id(s) in the output, e.g. {extra[:5]}"
    assert len(found) == len(set(input_ids))
    return Counter(s[0] for s in found.values())


def progress_files(folder: Path, pattern: str = "*") -> dict[str, int]:
    """Visible files of ``folder`` (name -> mtime_ns): which shards are done, and whether they were rewritten."""
    return {p.name: p.stat().st_mtime_ns for p in folder.glob(pattern) if not p.name.startswith(".")} if folder.exists() else {}


def sigkill_after_progress(argv: list[str], progress: Path, shards: int, *, timeout_s: float) -> tuple[int, float]:
    """Start ``argv`` in its own session, SIGKILL it once ``shards`` progress records exist
    under ``progress`` (mid-step); return its pid and the monotonic time of the kill."""
    import os
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while len(progress_files(progress, "*.json")) < shards:
            assert proc.poll() is None, f"it ended before it could be killed: {proc.stdout.read().decode()[-3000:]}"  # type: ignore[union-attr]
            assert time.monotonic() < deadline, f"no progress under {progress} within {timeout_s:.0f} s"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return proc.pid, killed_at
