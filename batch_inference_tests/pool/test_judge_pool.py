"""Retry tasks whose judge has its own model: each wave is judged on the judge pool.

The infer engine never approves as a judge (approval 0) and the judge engine always does
(approval 1), so where a verdict came from shows in the verdict itself. The ``process``
tests put HTTP between the infer worker and the judge pool: a busy judge pool is waited
for, and its infrastructure errors reach the driver as the infer pool's own do.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from batch_inference.judges import JudgeConfig
from batch_inference.pool import InferConfig, PoolClient, SamplingConfig, TaskConflict, TaskFailed, TaskResult, TaskSpec
from batch_inference.pool.engine_host import BatcherOptions, EngineHost
from batch_inference.pool.protocol import JUDGE_POOL_OUTPUT
from batch_inference.pool.runtime import WorkerRuntime
from batch_inference.pool.worker import WorkerSettings, create_app
from batch_inference.storage import CheckpointStore, JsonlFile
from batch_inference_tests.fixtures.pool import read_rows, write_shard


def sim(approval: float, seed: int = 0) -> dict[str, Any]:
    return {"kind": "simulated", "seed": seed,
            "simulated": {"latency_a_s": 0.0, "latency_b_s": 0.0, "approval_rate": approval}}


NEVER, ALWAYS = sim(0.0), sim(1.0, seed=1)
INFER = InferConfig(template="Answer: {q}", sampling=SamplingConfig(max_tokens=8, temperature=1.0, seed=3))
JUDGE = JudgeConfig(kind="llm", template="Judge this answer: {result}")


def retry_spec(tmp_path: Path, *, judge_pool: bool, task_id: str = "run/r00/retry/0", **kw: Any) -> TaskSpec:
    outputs = {"output": str(tmp_path / "out.jsonl.zst"), "checkpoint": str(tmp_path / "ckpt")}
    if judge_pool:
        outputs[JUDGE_POOL_OUTPUT] = str(tmp_path / "judge-waves")
    return TaskSpec(task_id=task_id, kind="retry", input_url=str(tmp_path / "in.jsonl.zst"), outputs=outputs,
                    infer=INFER, judge=kw.pop("judge", JUDGE), max_attempts=3, chunk_size=kw.pop("chunk_size", 16), **kw)


async def test_a_retry_task_judges_each_wave_on_the_judge_pool(tmp_path: Path, inprocess_pool) -> None:
    ids = write_shard(tmp_path / "in.jsonl.zst", 40)
    async with inprocess_pool(ALWAYS, concurrency=2) as judge, inprocess_pool(NEVER, concurrency=2, judge_runner=judge) as infer:
        result = await infer.run_task(retry_spec(tmp_path, judge_pool=True))
        judged = await judge.stats()
        own = await infer.stats()
    rows = read_rows(tmp_path / "out.jsonl.zst")
    assert [r["id"] for r in rows] == ids
    # approved at the first attempt: only the judge's own model approves
    assert result.counts["approved"] == 40 and all(r["status"] == "approved" and r["attempts"] == 1 for r in rows)
    assert all(r["verdict"]["reason"] == "judge_approved" for r in rows)
    assert judged["tasks_completed"] == 3  # one judge task per wave: 40 records in chunks of 16
    assert judged["records_done"] == 40 and own["records_done"] == 40
    assert result.tokens_out > sum(len(r["result"].split()) for r in rows)  # the judge's replies count too
    assert not any((tmp_path / "judge-waves").iterdir())  # the waves' scratch shards are removed


async def test_without_the_judge_pool_output_the_task_judges_on_its_own_engine(tmp_path: Path, inprocess_pool) -> None:
    write_shard(tmp_path / "in.jsonl.zst", 10)
    async with inprocess_pool(ALWAYS) as judge, inprocess_pool(NEVER, judge_runner=judge) as infer:
        result = await infer.run_task(retry_spec(tmp_path, judge_pool=False))
        assert (await judge.stats())["tasks_completed"] == 0
    assert result.counts == {"approved": 0, "max_attempts": 10, "error": 0}


async def test_a_worker_without_a_judge_pool_refuses_the_task_naming_why(tmp_path: Path, inprocess_pool) -> None:
    write_shard(tmp_path / "in.jsonl.zst", 4)
    async with inprocess_pool(NEVER) as infer:
        with pytest.raises(TaskFailed, match="this worker has none .*--judge-endpoint"):
            await infer.run_task(retry_spec(tmp_path, judge_pool=True))


async def test_a_failing_judge_pool_fails_the_task_not_its_records(tmp_path: Path, inprocess_pool) -> None:
    """A wave the judge pool cannot judge fails the retry task (the pool retries it, then
    the shard is quarantined): no record is written as an error, and the checkpoints keep
    the inferred results, so a retried task judges them without inferring them again."""
    ids = write_shard(tmp_path / "in.jsonl.zst", 6)
    async with inprocess_pool(ALWAYS) as judge, inprocess_pool(NEVER, judge_runner=judge) as infer:
        real = judge.run_task

        async def down(spec: TaskSpec) -> Any:
            raise TaskFailed(spec, ["judge pool unreachable"])

        judge.run_task = down  # type: ignore[method-assign]
        with pytest.raises(TaskFailed, match="judge pool failed a wave of 6.*judge pool unreachable"):
            await infer.run_task(retry_spec(tmp_path, judge_pool=True))
        assert not JsonlFile(str(tmp_path / "out.jsonl.zst")).exists_sync()
        states = await CheckpointStore(str(tmp_path / "ckpt")).load()
        assert sorted(states) == ids and all(s["last_result"] for s in states.values())
        judge.run_task = real  # type: ignore[method-assign]
        calls = infer.host.engine.calls
        result = await infer.run_task(retry_spec(tmp_path, judge_pool=True, task_id="run/r00/retry/0-again"))
        assert infer.host.engine.calls == calls  # judged from the checkpoint, not inferred again
    assert result.counts["approved"] == 6


async def test_the_tail_generates_on_the_infer_pool_while_the_judge_pool_judges(tmp_path: Path, inprocess_pool) -> None:
    """The two pools work at once: the judge pool is sent a chunk's wave while the task's
    next chunk is in the infer engine. The first judge request is held until the infer
    engine has one outstanding (bounded): were the task to take turns (judge a chunk, then
    generate), none could arrive, and the hold would run out."""
    import asyncio

    ids = write_shard(tmp_path / "in.jsonl.zst", 48)
    half = sim(0.5, seed=1)  # the judge rejects some: the groups go round more than once
    async with inprocess_pool(half, concurrency=2) as judge, inprocess_pool(NEVER, concurrency=2, judge_runner=judge) as infer:
        outstanding = 0
        arrived = asyncio.Event()
        submit = infer.host.submit

        async def counting_submit(requests: list[Any], **kw: Any) -> list[asyncio.Future[Any]]:
            nonlocal outstanding
            futures = await submit(requests, **kw)
            outstanding += len(futures)
            arrived.set()

            def done(_: asyncio.Future[Any]) -> None:
                nonlocal outstanding
                outstanding -= 1

            for f in futures:
                f.add_done_callback(done)
            return futures

        infer.host.submit = counting_submit  # type: ignore[method-assign]
        run_judge = judge.run_task
        seen: list[tuple[int, int]] = []  # (rows in the wave, infer requests outstanding while it was held)

        async def held_judge(spec: TaskSpec) -> Any:
            if not seen and outstanding == 0:
                arrived.clear()
                try:
                    await asyncio.wait_for(arrived.wait(), timeout=10.0)
                except TimeoutError:
                    pass
            rows = len(read_rows(Path(spec.input_url)))
            seen.append((rows, outstanding))
            return await run_judge(spec)

        judge.run_task = held_judge  # type: ignore[method-assign]
        result = await infer.run_task(retry_spec(tmp_path, judge_pool=True, chunk_size=16))
    rows = read_rows(tmp_path / "out.jsonl.zst")
    # exactly once each, as without the overlap
    assert [r["id"] for r in rows] == ids and sum(result.counts.values()) == 48  # in input order
    assert all(r["status"] in ("approved", "max_attempts") and 1 <= r["attempts"] <= 3 for r in rows)
    assert seen[0][0] == 16  # the first chunk's wave, whole
    assert seen[0][1] > 0, seen  # ... went to the judge while the second chunk was generating
    assert sum(n for n, _ in seen) == sum(r["attempts"] for r in rows if r["status"] == "approved") + sum(
        3 for r in rows if r["status"] == "max_attempts")  # every attempt judged once, never twice


@pytest.mark.parametrize("failure", ["disk_full", "conflict"])
async def test_an_infrastructure_error_of_the_judge_pool_fails_the_task_never_a_record(
        tmp_path: Path, inprocess_pool, failure: str) -> None:
    """A judge worker's disk full (507: OSError ENOSPC) or a task id held with another spec
    (409: TaskConflict) is the infrastructure's, not the records': the task stops the run as
    the same error does on the infer side (no retry can help, no quarantine), no row is
    written with it, and the checkpoints keep every inferred result for the resumed task."""
    ids = write_shard(tmp_path / "in.jsonl.zst", 6)
    async with inprocess_pool(ALWAYS) as judge, inprocess_pool(NEVER, judge_runner=judge, retries=1, backoff_s=0.01) as infer:
        real = judge.run_task

        async def broken(spec: TaskSpec) -> Any:
            if failure == "disk_full":
                raise OSError(errno.ENOSPC, "No space left on device (judge worker: HTTP 507)")
            raise TaskConflict(spec, "HTTP 409: held with a different spec")

        judge.run_task = broken  # type: ignore[method-assign]
        want = OSError if failure == "disk_full" else TaskConflict
        with pytest.raises(want) as raised:
            await infer.run_task(retry_spec(tmp_path, judge_pool=True))
        assert not isinstance(raised.value, TaskFailed)  # never the shard's fault: no quarantine
        if failure == "disk_full":
            assert raised.value.errno == errno.ENOSPC
        assert not JsonlFile(str(tmp_path / "out.jsonl.zst")).exists_sync()  # no record ends with it
        states = await CheckpointStore(str(tmp_path / "ckpt")).load()
        assert sorted(states) == ids and all(s["last_result"] and "final" not in s for s in states.values())
        judge.run_task = real  # type: ignore[method-assign]
        result = await infer.run_task(retry_spec(tmp_path, judge_pool=True, task_id="run/r00/retry/0-again"))
    assert result.counts == {"approved": 6, "max_attempts": 0, "error": 0}


async def test_a_busy_in_process_judge_pool_is_waited_for(tmp_path: Path, inprocess_pool) -> None:
    """Four retry tasks on an infer pool of 4 slots send their waves to a judge pool of 1 slot:
    a wave that finds it busy waits for the slot, never fails its task."""
    import asyncio

    for s in range(4):
        write_shard(tmp_path / f"in{s}.jsonl.zst", 20, prefix=f"s{s}-")
    slow_judge = {**ALWAYS, "simulated": {**ALWAYS["simulated"], "latency_a_s": 0.01}}
    async with inprocess_pool(slow_judge, concurrency=1) as judge, \
            inprocess_pool(NEVER, concurrency=4, judge_runner=judge) as infer:
        specs = [retry_spec(tmp_path / f"t{s}", judge_pool=True, task_id=f"run/tail/{s}", chunk_size=5).model_copy(
            update={"input_url": str(tmp_path / f"in{s}.jsonl.zst")}) for s in range(4)]
        for s in range(4):
            (tmp_path / f"t{s}").mkdir()
        results = await asyncio.gather(*(infer.run_task(spec) for spec in specs))
        judged = await judge.stats()
    assert [r.counts for r in results] == [{"approved": 20, "max_attempts": 0, "error": 0}] * 4
    assert judged["tasks_completed"] == 16 and judged["tasks_refused"] == 0  # 4 waves per task, each waited for


async def test_a_wave_whose_verdicts_cannot_be_read_fails_the_task_which_is_retried(tmp_path: Path, inprocess_pool) -> None:
    """The judge pool's split of a wave is read back from storage; a corrupt (or missing)
    file there is a storage failure, not the records' and not an unusable input: the task
    is retried, the wave judged again (its unreadable files removed), and every record judged."""
    write_shard(tmp_path / "in.jsonl.zst", 6)
    async with inprocess_pool(ALWAYS) as judge, inprocess_pool(NEVER, judge_runner=judge, retries=1, backoff_s=0.01) as infer:
        real, calls = judge.run_task, {"n": 0}

        async def corrupting(spec: TaskSpec) -> Any:
            result = await real(spec)
            calls["n"] += 1
            if calls["n"] == 1:
                Path(spec.outputs["approved"]).write_bytes(b"\x28\xb5\x2f\xfd not a zstd frame")
            return result

        judge.run_task = corrupting  # type: ignore[method-assign]
        result = await infer.run_task(retry_spec(tmp_path, judge_pool=True))
        assert infer.retried == 1 and calls["n"] == 2
    assert result.counts == {"approved": 6, "max_attempts": 0, "error": 0}
    assert all(r["status"] == "approved" and r["error"] is None for r in read_rows(tmp_path / "out.jsonl.zst"))


def _url(server: TestServer) -> str:
    return str(server.make_url("")).rstrip("/")


@pytest.mark.process  # served by aiohttp on 127.0.0.1
async def test_over_http_the_workers_judge_client_waits_out_a_busy_judge_pool() -> None:
    """More refusals than a driver's client takes (100): a judge pool whose slots other
    workers' waves hold is waited for, then the wave runs."""
    from batch_inference.pool.worker import judge_pool_client

    refusals = {"left": 150}

    async def busy_then_done(request: web.Request) -> web.Response:
        spec = TaskSpec.model_validate_json(await request.read())
        if refusals["left"]:
            refusals["left"] -= 1
            return web.json_response({"error": "all 8 slots busy", "retryable": True}, status=429)
        result = TaskResult(task_id=spec.task_id, kind="judge", worker="judge", counts={"approved": 1}, records_in=1)
        return web.Response(body=result.model_dump_json(), content_type="application/json")

    app = web.Application()
    app.router.add_post("/tasks", busy_then_done)
    wave = retry_spec(Path("/data"), judge_pool=True).model_copy(update={"task_id": "run/tail/0/judge/ab"})
    async with TestServer(app, host="127.0.0.1") as server:
        client = judge_pool_client(WorkerSettings(judge_endpoints=[_url(server)]))
        client.backoff_s = client.max_backoff_s = 0.0005  # the policy under test is how many, not how long
        async with client:
            result = await client.run_task(wave)
    assert result.counts == {"approved": 1} and refusals["left"] == 0 and client.retried == 0


class _BrokenJudgePool:
    """A judge pool that answers every wave with ``error`` (what PoolClient raises for a 409 or a 507)."""

    limit, retried = 4, 0

    def __init__(self, error: str) -> None:
        self.error = error

    async def run_task(self, spec: TaskSpec) -> TaskResult:
        if self.error == "disk_full":
            raise OSError(errno.ENOSPC, "http://judge:8001: No space left on device")
        raise TaskConflict(spec, "http://judge:8001: HTTP 409: already finished with a different spec")

    async def stats(self) -> dict[str, Any]:
        return {}


@pytest.mark.process  # a worker app served by aiohttp on 127.0.0.1
@pytest.mark.parametrize("error", ["disk_full", "conflict"])
async def test_over_http_an_infrastructure_error_of_the_judge_pool_reaches_the_driver_as_the_infer_pools_own(
        tmp_path: Path, error: str) -> None:
    write_shard(tmp_path / "in.jsonl.zst", 6)
    host = EngineHost(NEVER, BatcherOptions())
    await host.start()
    try:
        runtime = WorkerRuntime(host, concurrency=2, judge_runner=_BrokenJudgePool(error))  # type: ignore[arg-type]
        app = create_app(runtime, WorkerSettings(storage_roots=[str(tmp_path)]))
        async with TestServer(app, host="127.0.0.1") as server, PoolClient([_url(server)], retries=2, backoff_s=0.01) as driver:
            with pytest.raises(OSError if error == "disk_full" else TaskConflict) as raised:
                await driver.run_task(retry_spec(tmp_path, judge_pool=True))
    finally:
        await host.close()
    assert not isinstance(raised.value, TaskFailed) and driver.retried == 0  # stops the run: never retried, never quarantined
    if error == "disk_full":
        assert raised.value.errno == errno.ENOSPC
    assert not JsonlFile(str(tmp_path / "out.jsonl.zst")).exists_sync()  # no record ends with the error
