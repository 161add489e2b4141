"""Security of the worker API and of what the system records.

The worker refuses to serve off loopback without a token and refuses requests without
it; every URL a task names must lie under the worker's storage roots; oversized bodies,
pickles and rule judges naming arbitrary modules are refused; and secrets (the token,
storage keys) never appear in logs, the ledger or Dagster metadata.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from batch_inference.pool.engine_host import EngineHost
from batch_inference.pool.runtime import WorkerRuntime
from batch_inference.pool.worker import WorkerSettings, check_security, create_app
from batch_inference_tests.faults.helpers import make_spec, write_input
from batch_inference_tests.fixtures.pool import SIM_ENGINE, infer_spec, write_shard

TOKEN = "tok-5f1c9e0d7a3b4c2e"
AWS_KEY, AWS_SECRET = "AKIAFAULTSUITE0000001", "fault/suite+SECRET/key0000000000000000000"
CLI = [sys.executable, "-m", "batch_inference.cli.main"]


@pytest.fixture
async def worker(tmp_path: Path) -> AsyncIterator[tuple[TestClient, Path]]:
    """A real worker app (token set, local root + an s3 root) served on 127.0.0.1."""
    root = tmp_path / "data"
    root.mkdir()
    host = EngineHost(SIM_ENGINE)
    await host.start()
    settings = WorkerSettings(storage_roots=[str(root), "s3://good-bucket/runs"], token=TOKEN, max_body_bytes=64 * 1024)
    client = TestClient(TestServer(create_app(WorkerRuntime(host, concurrency=2), settings), host="127.0.0.1"))
    await client.start_server()
    try:
        yield client, root
    finally:
        await client.close()
        await host.close()


AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


def _body(spec: Any) -> str:
    return spec.model_dump_json()


@pytest.mark.process
def test_off_loopback_needs_a_token(tmp_path: Path) -> None:
    for host in ("0.0.0.0", "10.1.2.3", "::"):
        with pytest.raises(PermissionError, match="token"):
            check_security(WorkerSettings(host=host))
        check_security(WorkerSettings(host=host, token=TOKEN))
    check_security(WorkerSettings(host="127.0.0.1"))
    engine = tmp_path / "engine.json"
    engine.write_text(json.dumps(SIM_ENGINE))
    env = {k: v for k, v in os.environ.items() if k != "BATCH_INFERENCE_TOKEN"}
    res = subprocess.run([*CLI, "worker", "--engine-config", str(engine), "--host", "0.0.0.0", "--port", "0"],
                         capture_output=True, timeout=60, env=env)
    assert res.returncode != 0 and b"token" in res.stderr + res.stdout


@pytest.mark.process
async def test_requests_without_the_right_token_are_refused(worker: tuple[TestClient, Path]) -> None:
    client, root = worker
    write_shard(root / "in.jsonl", 5)
    body = _body(infer_spec("t-auth", root / "in.jsonl", root / "out.jsonl"))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, {"Authorization": f"Basic {TOKEN}"}):
        resp = await client.post("/tasks", data=body, headers={**headers, "Content-Type": "application/json"})
        assert resp.status == 401, headers
        assert TOKEN not in await resp.text()
    for path in ("/stats", "/metrics"):
        assert (await client.get(path)).status == 401
    assert (await client.get("/health")).status == 200  # probes need no secret
    resp = await client.post("/tasks", data=body, headers=AUTH)
    assert resp.status == 200, await resp.text()
    assert not (root / "out.jsonl").exists() or (root / "out.jsonl").stat().st_size > 0


@pytest.mark.process
@pytest.mark.parametrize("where", ["input_url", "output"])
async def test_paths_outside_the_storage_roots_are_refused(worker: tuple[TestClient, Path], where: str) -> None:
    client, root = worker
    write_shard(root / "in.jsonl", 3)
    outside = [
        f"{root}/../secret.jsonl", "/etc/passwd", f"{root}2/x.jsonl", "s3://other-bucket/runs/x.jsonl",
        "s3://good-bucket/runs/../private/x.jsonl", "s3://good-bucket/runs2/x.jsonl", "file:///good-bucket/runs/x.jsonl",
        "file://relative/x.jsonl", "gs://good-bucket/runs/x.jsonl", "memory://good-bucket/runs/x.jsonl",
    ]
    for i, url in enumerate(outside):
        spec = (infer_spec(f"t-out-{where}-{i}", url, root / "out.jsonl") if where == "input_url"
                else infer_spec(f"t-out-{where}-{i}", root / "in.jsonl", url))
        resp = await client.post("/tasks", data=_body(spec), headers=AUTH)
        assert resp.status == 403, (url, resp.status, await resp.text())
    assert not (root / "out.jsonl").exists()


@pytest.mark.process
async def test_oversized_bodies_pickles_and_arbitrary_rule_modules_are_refused(worker: tuple[TestClient, Path]) -> None:
    client, root = worker
    write_shard(root / "in.jsonl", 3)
    spec = infer_spec("t-big", root / "in.jsonl", root / "out.jsonl")
    big = json.loads(_body(spec))
    big["infer"]["template"] = "x" * (128 * 1024)
    resp = await client.post("/tasks", data=json.dumps(big), headers=AUTH)
    assert resp.status == 413

    resp = await client.post("/tasks", data=pickle.dumps(spec.model_dump()), headers={**AUTH, "Content-Type": "application/octet-stream"})
    assert resp.status == 400

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, ("touch pwned",))

    resp = await client.post("/tasks", data=pickle.dumps(Evil()), headers=AUTH)
    assert resp.status == 400 and not Path("pwned").exists()

    extra = json.loads(_body(spec))
    extra["__reduce__"] = "os.system"
    assert (await client.post("/tasks", data=json.dumps(extra), headers=AUTH)).status == 400

    judge = {"task_id": "t-rule", "kind": "judge", "input_url": str(root / "in.jsonl"),
             "outputs": {"approved": str(root / "a.jsonl"), "rejected": str(root / "r.jsonl")},
             "judge": {"kind": "rule", "callable": "subprocess:run", "kwargs": {"shell": True}}}
    resp = await client.post("/tasks", data=json.dumps(judge), headers=AUTH)
    assert resp.status == 403 and "allow-rule-module" in await resp.text()
    judge["judge"] = {"kind": "rule", "callable": "min_length"}  # built-ins are always allowed
    judge["task_id"] = "t-rule-ok"
    resp = await client.post("/tasks", data=json.dumps(judge), headers=AUTH)
    assert resp.status == 200, await resp.text()


@pytest.mark.process
def test_the_token_never_reaches_the_worker_log(tmp_path: Path) -> None:
    """A real worker process with a token: its whole log, after refused and accepted requests."""
    import urllib.error
    import urllib.request

    engine = tmp_path / "engine.json"
    engine.write_text(json.dumps(SIM_ENGINE))
    ready = tmp_path / "ready.json"
    write_shard(tmp_path / "in.jsonl", 4)
    proc = subprocess.Popen(
        [*CLI, "worker", "--engine-config", str(engine), "--port", "0", "--ready-file", str(ready),
         "--storage-root", str(tmp_path), "--grace-s", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "BATCH_INFERENCE_TOKEN": TOKEN},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        url = f"http://127.0.0.1:{json.loads(ready.read_text())['port']}/tasks"
        body = _body(infer_spec("t-log", tmp_path / "in.jsonl", tmp_path / "out.jsonl")).encode()
        for token in ("wrong", TOKEN):
            req = urllib.request.Request(url, data=body, headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
            try:
                urllib.request.urlopen(req, timeout=30).read()
            except urllib.error.HTTPError as exc:
                assert exc.code == 401
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    log = out.decode(errors="replace")
    assert "refused POST /tasks" in log and (tmp_path / "out.jsonl").exists()
    assert TOKEN not in log


async def test_storage_secrets_never_reach_logs_ledger_or_metadata(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A run whose storage options carry keys, with a quarantined shard and errors along the way."""
    from batch_inference.defs.metadata import phase_metadata
    from batch_inference.pipeline import Ledger, RunLayout, run_pipeline
    from batch_inference.storage.urls import fs_for

    ids = write_input(tmp_path / "input.jsonl", 120)
    options = {"key": AWS_KEY, "secret": AWS_SECRET, "token": TOKEN}
    spec = make_spec(tmp_path, output="memory://faults-secrets/out", storage_options=options,
                     pool={"storage_options_ref": "s3", "concurrency": 2},
                     engine={"kind": "simulated", "simulated": {"approval_rate": 0.5, "latency_a_s": 0.0, "fail_batch_every": 4}})
    caplog.set_level(logging.DEBUG)
    summary = await run_pipeline(spec)
    assert summary.records == len(ids)
    fs, root = fs_for("memory://faults-secrets/out", options)
    texts = [caplog.text, repr(spec), str(spec.public_dict())]
    texts += [fs.cat_file(p).decode(errors="replace") for p in fs.find(root) if "/ledger/" in p]
    view = Ledger(RunLayout(spec.output, spec.run), options).view()
    for rnd in view.rounds:
        texts.append(repr(phase_metadata(rnd.infer)) + repr(phase_metadata(rnd)))
    texts.append(repr(summary.as_dict()))
    leaked = [t[:200] for t in texts if any(s in t for s in (AWS_KEY, AWS_SECRET, TOKEN))]
    assert not leaked, leaked
    assert any('"key": "***"' in t or "'key': '***'" in t for t in texts), "the ledger records the spec, redacted"


@pytest.mark.slow
def test_secrets_never_reach_the_dagster_event_log(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A whole Dagster-driven run with credentials in the spec file and in the storage resource:
    no event (materialisation metadata, check results, logs) and no ledger object carries them."""
    import dagster as dg
    import yaml
    from dagster._serdes import serialize_value

    from batch_inference.definitions import build_definitions
    from batch_inference.defs.driver import drive, start_run
    from batch_inference.defs.pool.resources import PoolResource
    from batch_inference.defs.runs.jobs import start_run_config
    from batch_inference.defs.storage.resources import StorageResource
    from batch_inference_tests.faults.helpers import spec_data

    write_input(tmp_path / "input.jsonl", 60)
    data = spec_data(tmp_path, run="secrets", storage_options={"key": AWS_KEY, "secret": AWS_SECRET},
                     judge={"kind": "rule", "callable": "regex", "kwargs": {"pattern": "^APPROVED"}},
                     engine={"kind": "simulated", "simulated": {"approval_rate": 0.5, "latency_a_s": 0.0, "fail_batch_every": 3}})
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(data))
    storage = StorageResource(aws_access_key_id=AWS_KEY, aws_secret_access_key=AWS_SECRET, aws_session_token=TOKEN)
    defs = build_definitions(pool=PoolResource(mode="inprocess"), storage=storage)
    instance = dg.DagsterInstance.ephemeral()
    assert start_run(defs, instance, start_run_config(str(spec_path))).success
    result = drive(defs, instance)
    assert result.launched and all(r.success for r in result.launched), result.launched
    events = [serialize_value(e) for run in instance.get_runs() for e in instance.all_logs(run.run_id)]
    assert any("round_conservation" in e for e in events)
    assert any("***" in e for e in events), "the spec is recorded in the metadata, redacted"
    ledger = [p.read_text(errors="replace") for p in (tmp_path / "out" / "secrets" / "ledger").rglob("*.json")]
    out, err = capfd.readouterr()
    leaked = [t[:200] for t in [*events, *ledger, out, err] if any(s in t for s in (AWS_KEY, AWS_SECRET, TOKEN))]
    assert not leaked, leaked
