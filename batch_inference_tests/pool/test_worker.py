"""Real worker processes on loopback: one engine load, shared batching, refusals, lifecycle."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import psutil
import pytest

from batch_inference.pool import PoolClient, TaskFailed, dispatch_bounded
from batch_inference.pool.worker import WorkerSettings, check_security
from batch_inference_tests.fixtures.pool import SIM_ENGINE, infer_spec, kill_worker, read_rows, wait_until, write_shard

SLOW_ENGINE = {"kind": "simulated", "simulated": {"latency_a_s": 0.03, "latency_b_s": 0.0}}


async def _get(endpoint: str, path: str, token: str | None = None) -> tuple[int, dict | str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as s, s.get(endpoint + path, headers=headers) as resp:
        return resp.status, (await resp.json() if resp.content_type == "application/json" else await resp.text())


async def _post(endpoint: str, body: bytes | str, token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    async with aiohttp.ClientSession() as s, s.post(endpoint + "/tasks", data=body, headers=headers) as resp:
        return resp.status, await resp.json()


async def test_engine_loaded_once_per_worker_across_many_tasks(tmp_path: Path, local_pool) -> None:
    launcher = local_pool(replicas=2, concurrency=3)
    pids = sorted(s.pid for s in launcher.status())
    specs = []
    for i in range(12):
        write_shard(tmp_path / f"in{i}.jsonl", 50, prefix=f"s{i}-")
        specs.append(infer_spec(f"t{i}", tmp_path / f"in{i}.jsonl", tmp_path / f"out{i}.jsonl"))
    results = []
    async with launcher.client() as pool:
        assert pool.limit == 6
        await dispatch_bounded(specs, pool.run_task, results.append, limit=pool.limit)
        stats = await pool.stats()
    assert sorted(r.task_id for r in results) == sorted(f"t{i}" for i in range(12))
    assert len({r.worker for r in results}) == 2  # spread over both workers
    per_worker = [s for s in stats["workers"].values()]
    assert [s["engine_loads"] for s in per_worker] == [1, 1]  # 12 tasks, 2 engine loads in all
    assert sum(s["tasks_completed"] for s in per_worker) == 12
    assert sorted(s["pid"] for s in per_worker) == pids  # the same processes served every task


async def test_shared_batcher_merges_records_of_concurrent_tasks(tmp_path: Path, local_pool) -> None:
    launcher = local_pool(replicas=1, concurrency=8, batcher={"batch_timeout_s": 0.5})
    specs = []
    for i in range(8):
        write_shard(tmp_path / f"in{i}.jsonl", 20, prefix=f"s{i}-")
        specs.append(infer_spec(f"t{i}", tmp_path / f"in{i}.jsonl", tmp_path / f"out{i}.jsonl", chunk_size=20))
    async with launcher.client() as pool:
        await asyncio.gather(*(pool.run_task(s) for s in specs))
        (stats,) = (await pool.stats())["workers"].values()
    assert stats["batcher"]["total_completed"] == 160
    assert stats["batcher"]["avg_batch_size"] > 20  # a single task's chunk is 20 records


async def test_sigkill_mid_task_is_retried_elsewhere_and_each_record_written_once(tmp_path: Path, local_pool) -> None:
    launcher = local_pool(SLOW_ENGINE, replicas=2, concurrency=2, batcher={"max_batch_size": 8})
    victim = launcher.status()[0]
    inputs = {}
    specs = []
    for i in range(6):
        inputs[i] = write_shard(tmp_path / f"in{i}.jsonl", 80, prefix=f"s{i}-")
        specs.append(infer_spec(f"t{i}", tmp_path / f"in{i}.jsonl", tmp_path / "out" / f"part-{i:05d}.jsonl"))
    (tmp_path / "out").mkdir()
    results = []
    async with launcher.client(backoff_s=0.05) as pool:
        run = asyncio.create_task(dispatch_bounded(specs, pool.run_task, results.append, limit=pool.limit))
        await wait_until(lambda: _running(victim.endpoint), timeout_s=30)
        kill_worker(victim.pid, signal.SIGKILL)
        await asyncio.wait_for(run, 120)
        assert pool.retried >= 1
    assert sorted(r.task_id for r in results) == sorted(f"t{i}" for i in range(6))
    for i in range(6):
        ids = [row["id"] for row in read_rows(tmp_path / "out" / f"part-{i:05d}.jsonl")]
        assert ids == inputs[i]  # every record exactly once, in order
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if not p.name.startswith(".")) == [f"part-{i:05d}.jsonl" for i in range(6)]
    # the dead worker was restarted on demand: two healthy workers again, a new pid in slot 0
    await wait_until(lambda: sum(s.healthy for s in launcher.status()) == 2, timeout_s=60)
    assert victim.pid not in {s.pid for s in launcher.status()}


async def _running(endpoint: str) -> bool:
    status, stats = await _get(endpoint, "/stats")
    return status == 200 and stats["tasks_running"] > 0 and stats["batcher"]["total_batches"] > 2


async def test_idempotent_rerequest_returns_cached_result(tmp_path: Path, worker_process) -> None:
    _, endpoint, _ = worker_process("--concurrency", "2")
    write_shard(tmp_path / "in.jsonl", 30)
    spec = infer_spec("once", tmp_path / "in.jsonl", tmp_path / "out.jsonl")
    async with PoolClient([endpoint]) as pool:
        first = await pool.run_task(spec)
        again = await pool.run_task(spec)
    _, stats = await _get(endpoint, "/stats")
    assert not first.cached and again.cached and again.counts == first.counts
    assert stats["tasks_completed"] == 1 and stats["tasks_cached"] == 1


async def test_refusals_outside_roots_bad_spec_oversize_and_busy(tmp_path: Path, worker_process) -> None:
    root = tmp_path / "data"
    root.mkdir()
    _, endpoint, log_path = worker_process("--concurrency", "1", "--storage-root", str(root), "--max-batch-size", "2", engine=SLOW_ENGINE)
    write_shard(root / "in.jsonl", 40)
    outside = infer_spec("evil", root / "in.jsonl", tmp_path / "stolen.jsonl")
    traversal = infer_spec("evil2", f"{root}/../secret.jsonl", root / "o.jsonl")
    other_scheme = infer_spec("evil3", "memory://data/in.jsonl", root / "o.jsonl")
    for spec in (outside, traversal, other_scheme):
        status, body = await _post(endpoint, spec.model_dump_json())
        assert status == 403 and body["retryable"] is False, body
    assert "refused task evil: " in log_path.read_text() and "outside the storage roots" in log_path.read_text()
    status, body = await _post(endpoint, b'{"task_id": "x", "kind": "infer", "pickle": "no"}')
    assert status == 400 and "bad task spec" in body["error"]
    status, body = await _post(endpoint, b'{"task_id": "' + b"x" * (2 << 20) + b'"}')
    assert status == 413
    long_task = asyncio.create_task(_post(endpoint, infer_spec("long", root / "in.jsonl", root / "o1.jsonl").model_dump_json()))
    await wait_until(lambda: _get_running(endpoint), timeout_s=30)
    status, body = await _post(endpoint, infer_spec("second", root / "in.jsonl", root / "o2.jsonl").model_dump_json())
    assert status == 429 and body["retryable"] is True
    assert (await long_task)[0] == 200
    with pytest.raises(TaskFailed, match="403"):  # the client does not retry a deterministic refusal
        async with PoolClient([endpoint], retries=3) as pool:
            await pool.run_task(outside)


async def _get_running(endpoint: str) -> bool:
    return (await _get(endpoint, "/stats"))[1]["tasks_running"] > 0


async def test_bearer_token_required_when_configured(tmp_path: Path, worker_process) -> None:
    _, endpoint, _ = worker_process(env={"BATCH_INFERENCE_TOKEN": "s3cret-token"})
    write_shard(tmp_path / "in.jsonl", 5)
    body = infer_spec("t", tmp_path / "in.jsonl", tmp_path / "out.jsonl").model_dump_json()
    assert (await _post(endpoint, body))[0] == 401
    assert (await _post(endpoint, body, token="wrong"))[0] == 401
    assert (await _get(endpoint, "/stats", token="wrong"))[0] == 401
    assert (await _get(endpoint, "/health"))[0] == 200  # probes need no secret
    assert (await _post(endpoint, body, token="s3cret-token"))[0] == 200
    async with PoolClient([endpoint], token="s3cret-token") as pool:
        assert (await pool.stats())["tasks_completed"] == 1


async def test_off_loopback_bind_without_token_is_refused(tmp_path: Path, worker_process) -> None:
    proc, _, log_path = worker_process("--host", "0.0.0.0", env={"BATCH_INFERENCE_TOKEN": ""}, wait=False)
    assert proc.wait(timeout=60) != 0
    assert "bearer token is required" in log_path.read_text()
    with pytest.raises(PermissionError):
        check_security(WorkerSettings(host="10.1.2.3"))
    check_security(WorkerSettings(host="0.0.0.0", token="t"))  # with a token it may bind
    check_security(WorkerSettings(host="127.0.0.1"))


async def test_idle_ttl_shuts_the_worker_down(tmp_path: Path, worker_process) -> None:
    proc, endpoint, log_path = worker_process("--idle-ttl-s", "1")
    write_shard(tmp_path / "in.jsonl", 5)
    async with PoolClient([endpoint]) as pool:
        await pool.run_task(infer_spec("t", tmp_path / "in.jsonl", tmp_path / "out.jsonl"))
    assert proc.wait(timeout=30) == 0
    assert "idle for 1s" in log_path.read_text()


async def test_sigterm_finishes_running_tasks_within_grace(tmp_path: Path, worker_process) -> None:
    proc, endpoint, _ = worker_process("--grace-s", "30", "--max-batch-size", "4", engine=SLOW_ENGINE)
    write_shard(tmp_path / "in.jsonl", 40)
    task = asyncio.create_task(_post(endpoint, infer_spec("t", tmp_path / "in.jsonl", tmp_path / "out.jsonl").model_dump_json()))
    await wait_until(lambda: _get_running(endpoint), timeout_s=30)
    proc.send_signal(signal.SIGTERM)
    status, body = await task
    assert status == 200 and body["counts"]["ok"] == 40
    assert proc.wait(timeout=30) == 0
    assert len(read_rows(tmp_path / "out.jsonl")) == 40


async def test_sigterm_past_grace_abandons_cleanly(tmp_path: Path, worker_process) -> None:
    proc, endpoint, log_path = worker_process("--grace-s", "0.2", "--max-batch-size", "2", engine=SLOW_ENGINE)
    write_shard(tmp_path / "in.jsonl", 200)
    task = asyncio.create_task(_post(endpoint, infer_spec("t", tmp_path / "in.jsonl", tmp_path / "out.jsonl").model_dump_json()))
    await wait_until(lambda: _get_running(endpoint), timeout_s=30)
    proc.send_signal(signal.SIGTERM)
    status, body = await task
    assert status == 503 and body["retryable"] is True  # the client retries it elsewhere
    assert proc.wait(timeout=30) == 0
    assert not (tmp_path / "out.jsonl").exists()
    assert "abandoned 1 task(s)" in log_path.read_text()


async def test_stats_and_prometheus_metrics(tmp_path: Path, worker_process) -> None:
    _, endpoint, _ = worker_process()
    write_shard(tmp_path / "in.jsonl", 20)
    async with PoolClient([endpoint]) as pool:
        await pool.run_task(infer_spec("t", tmp_path / "in.jsonl", tmp_path / "out.jsonl"))
    status, stats = await _get(endpoint, "/stats")
    assert status == 200
    for key in ("utilization", "avg_fill", "records_per_s", "tokens_per_s", "tasks_running", "model_load_time_s", "uptime_s", "engine_loads"):
        assert key in stats
    assert stats["batcher"]["recent"]["batches"] >= 1 and stats["records_done"] == 20
    status, text = await _get(endpoint, "/metrics")
    assert status == 200
    assert "# TYPE batch_inference_engine_loads_total counter" in text
    assert 'batch_inference_records_total{worker="127.0.0.1:' in text
    assert "batch_inference_batcher_recent_utilization" in text


def test_launcher_reuses_a_running_pool_and_replaces_a_changed_one(tmp_path: Path, local_pool) -> None:
    from batch_inference.pool.launchers.local import LocalLauncher

    first = local_pool(replicas=2, concurrency=2)
    pids = sorted(s.pid for s in first.status())
    endpoints = first.up()  # same process, again: nothing restarted
    later = LocalLauncher(SIM_ENGINE, replicas=2, concurrency=2, storage_roots=[str(tmp_path)], state_dir=str(tmp_path / "pool-state"))
    assert later.up() == endpoints  # a later run finds the pool hot
    assert sorted(s.pid for s in later.status()) == pids
    kill_worker(pids[1], signal.SIGKILL)
    assert len(later.up()) == 2  # a dead worker is restarted on demand
    new_pids = sorted(s.pid for s in later.status())
    assert pids[0] in new_pids and pids[1] not in new_pids
    changed = local_pool(replicas=1, concurrency=3)  # another configuration replaces the pool
    assert len(changed.status()) == 1 and not set(new_pids) & {s.pid for s in changed.status()}
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in new_pids)
    assert changed.down() == 1 and changed.status() == []


@pytest.mark.process
def test_pool_cli_up_status_down(tmp_path: Path) -> None:
    state = str(tmp_path / "cli-state")
    base = [sys.executable, "-m", "batch_inference.cli.main", "pool"]
    try:
        up = subprocess.run([*base, "up", "--simulated-engine", "--replicas", "1", "--concurrency", "2", "--storage-root", str(tmp_path), "--state-dir", state],
                            capture_output=True, text=True, timeout=120)
        assert up.returncode == 0, up.stderr
        assert up.stdout.startswith("http://127.0.0.1:")
        status = subprocess.run([*base, "status", "--state-dir", state], capture_output=True, text=True, timeout=60)
        assert "healthy" in status.stdout and "loads=1" in status.stdout
    finally:
        down = subprocess.run([*base, "down", "--state-dir", state], capture_output=True, text=True, timeout=60)
    assert "stopped 1 worker(s)" in down.stdout


@pytest.mark.slow
async def test_tiny_model_worker_loads_once_and_serves_several_tasks(tmp_path: Path, local_pool, tiny_model_dir: Path) -> None:
    engine = {"kind": "transformers", "model": str(tiny_model_dir), "device": "cpu"}
    launcher = local_pool(engine, replicas=1, concurrency=2)
    from batch_inference.pool import InferConfig, SamplingConfig

    infer = InferConfig(template="Q: {q}\nA:", sampling=SamplingConfig(max_tokens=4, temperature=0.0))
    for i in range(3):
        write_shard(tmp_path / f"in{i}.jsonl", 4, prefix=f"s{i}-")
    async with launcher.client() as pool:
        results = await asyncio.gather(*(pool.run_task(infer_spec(f"t{i}", tmp_path / f"in{i}.jsonl", tmp_path / f"out{i}.jsonl", infer=infer)) for i in range(3)))
        (stats,) = (await pool.stats())["workers"].values()
    assert [r.counts for r in results] == [{"ok": 4, "error": 0}] * 3
    assert stats["engine_loads"] == 1 and stats["tasks_completed"] == 3
    assert all(isinstance(row["result"], str) and row["usage"]["completion_tokens"] >= 1 for row in read_rows(tmp_path / "out0.jsonl"))


async def test_scaledown_ttl_removes_idle_replicas_above_the_minimum(tmp_path: Path, local_pool) -> None:
    launcher = local_pool(replicas=2, min_replicas=1, idle_ttl_s=120, scaledown_ttl_s=1)
    base, extra = launcher.status()
    await wait_until(lambda: not psutil.pid_exists(extra.pid) or psutil.Process(extra.pid).status() == psutil.STATUS_ZOMBIE, timeout_s=30)
    assert [s.healthy for s in launcher.status()] == [True, False]  # the minimum stays hot
    assert len(launcher.up()) == 2  # work arrives: the replica comes back on demand


async def test_storage_profiles_come_from_the_worker_config(tmp_path: Path, worker_process) -> None:
    profiles = tmp_path / "profiles.yaml"
    profiles.write_text("local:\n  auto_mkdir: true\n")
    _, endpoint, _ = worker_process("--storage-options", str(profiles))
    write_shard(tmp_path / "in.jsonl", 5)
    spec = infer_spec("p", tmp_path / "in.jsonl", tmp_path / "out.jsonl", storage_options_ref="local")
    status, body = await _post(endpoint, spec.model_dump_json())
    assert status == 200 and body["counts"]["ok"] == 5
    status, body = await _post(endpoint, spec.model_copy(update={"task_id": "q", "storage_options_ref": "nope"}).model_dump_json())
    assert status == 400 and "unknown storage profile 'nope'" in body["error"] and body["retryable"] is False


async def test_a_cancelled_client_call_cancels_the_task_on_its_worker(tmp_path: Path, worker_process) -> None:
    """Over HTTP, cancelling ``PoolClient.run_task`` (a stopped run, a cancelled batch) cancels
    the task on the worker and returns once it has ended there: the worker's engine stops
    within a batch and its slot is free. Before, the worker ran the abandoned shard to its end
    (here 400 records, two a batch: ~6 s of batches) and refused the next task meanwhile."""
    _, endpoint, _ = worker_process("--concurrency", "1", "--max-batch-size", "2", engine=SLOW_ENGINE)
    write_shard(tmp_path / "in.jsonl", 400)
    write_shard(tmp_path / "b.jsonl", 4, prefix="b")
    async with PoolClient([endpoint], max_refusals=None) as pool:
        caller = asyncio.create_task(pool.run_task(infer_spec("long", tmp_path / "in.jsonl", tmp_path / "out.jsonl")))
        await wait_until(lambda: _running(endpoint), timeout_s=30)
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
        _, stats = await _get(endpoint, "/stats")
        assert stats["tasks_running"] == 0 and stats["tasks_cancelled"] == 1 and stats["tasks_failed"] == 0
        batches = stats["batcher"]["total_batches"]
        await asyncio.sleep(0.6)  # twenty batches' time
        _, stats = await _get(endpoint, "/stats")
        assert stats["batcher"]["total_batches"] <= batches + 1
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        short = await pool.run_task(infer_spec("short", tmp_path / "b.jsonl", tmp_path / "b-out.jsonl"))
        assert short.counts["ok"] == 4 and loop.time() - t0 < 2.0 and stats["tasks_refused"] == 0
    assert not (tmp_path / "out.jsonl").exists()


async def test_a_closed_connection_cancels_the_task_it_asked_for(tmp_path: Path, worker_process) -> None:
    """A client that goes away without a word (its process killed, a raw HTTP caller) closes its
    connection: the worker cancels the task nobody waits on any more."""
    _, endpoint, _ = worker_process("--concurrency", "1", "--max-batch-size", "2", engine=SLOW_ENGINE)
    write_shard(tmp_path / "in.jsonl", 400)
    caller = asyncio.create_task(_post(endpoint, infer_spec("long", tmp_path / "in.jsonl", tmp_path / "out.jsonl").model_dump_json()))
    await wait_until(lambda: _running(endpoint), timeout_s=30)
    caller.cancel()  # the session closes: the connection drops
    await asyncio.gather(caller, return_exceptions=True)

    async def cancelled() -> bool:
        _, stats = await _get(endpoint, "/stats")
        return stats["tasks_running"] == 0 and stats["tasks_cancelled"] == 1

    await wait_until(cancelled, timeout_s=3)
