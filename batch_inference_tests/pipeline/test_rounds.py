"""Strategy 1 (rounds) on the simulated engine through the real InProcessPool."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import orjson
import pytest

from batch_inference.pipeline import ConservationError, PipelineRun, run_pipeline
from batch_inference.pipeline.runner import open_runner
from batch_inference.pool.protocol import TaskFailed, TaskResult, TaskSpec
from batch_inference.storage import JsonlDir, JsonlFile
from batch_inference_tests.pipeline.helpers import CountingRunner, FailingShardRunner


def ledger(spec, name: str) -> dict:
    return orjson.loads((Path(spec.output) / spec.run / "ledger" / f"{name}.json").read_bytes())


async def test_rounds_converge_over_several_rounds(make_spec) -> None:
    spec = make_spec(approval=0.6, max_rounds=10, max_attempts=10)
    summary = await run_pipeline(spec)
    assert summary.status == "converged"
    assert summary.rounds >= 3
    assert summary.approved == 600 and summary.exhausted == summary.failed == 0
    assert summary.conservation["ok"] and summary.conservation["terminal"]["approved"] == 600
    results = list(JsonlDir(summary.results_url).iter_records_sync())
    assert len({r["id"] for r in results}) == 600
    assert all(r["status"] == "approved" and "rejection" not in r for r in results)
    rounds_seen = {r["round"] for r in results}
    assert len(rounds_seen) >= 3
    # a record approved in round r had r + 1 attempts
    assert all(r["attempts"] == r["round"] + 1 for r in results)
    # the approved + rejected == inferred check held per round, and the funnel shrinks
    sizes = [ledger(spec, f"round-{r:02d}-infer")["records_in"] for r in range(summary.rounds)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == 600
    assert ledger(spec, f"round-{summary.rounds - 1:02d}-decision")["kind"] == "done"


async def test_a_decision_carries_the_eta_of_the_estimate_the_run_is_given(make_spec) -> None:
    asked = []

    def eta(spec, r, infer, judge, decision_kind, *, recompact_s=0.0) -> float:
        asked.append((r, decision_kind, infer.records_in))
        return 12.34

    spec = make_spec(approval=0.6, max_rounds=10, max_attempts=10)
    assert (await run_pipeline(spec, eta=eta)).status == "converged"
    first = ledger(spec, "round-00-decision")
    assert first["figures"]["eta_run_s"] == 12.3 and asked[0] == (0, first["kind"], 600)

    def broken(*args, **kwargs) -> float:
        raise ZeroDivisionError("no throughput")

    failing = make_spec(approval=0.6, max_rounds=10, max_attempts=10, run="eta-fails")
    assert (await run_pipeline(failing, eta=broken)).status == "converged"  # an estimate never stops a run
    plain = make_spec(approval=0.6, max_rounds=10, max_attempts=10, run="no-eta")
    assert (await run_pipeline(plain)).status == "converged"
    for s in (failing, plain):
        assert "eta_run_s" not in ledger(s, "round-00-decision")["figures"]


async def test_recompaction_shrinks_the_shard_count(make_spec) -> None:
    spec = make_spec(approval=0.7, records=1000, max_rounds=3)
    summary = await run_pipeline(spec)
    shards = [ledger(spec, f"round-{r:02d}-infer")["shards"] for r in range(summary.rounds)]
    assert shards[0] == 10
    assert shards[1] == 3  # ~300 rejected of 1,000 in 100-record shards, not 10 shards of ~30
    assert shards[1] < shards[0] and shards[2] <= shards[1]
    rc = ledger(spec, "round-01-recompact")
    assert rc["shards_in"] == 10 and rc["shards_out"] == shards[1]
    pending = JsonlDir(str(Path(spec.output) / spec.run / "round-01" / "pending")).manifest()
    assert all(s["records"] == 100 for s in pending.shards[:-1])  # full shards but the last
    assert summary.conservation["ok"]


async def test_max_rounds_exhaustion_is_reported_not_success(make_spec) -> None:
    spec = make_spec(approval=0.3, max_rounds=2)
    summary = await run_pipeline(spec)
    assert summary.status == "exhausted"
    assert summary.rounds == 2
    assert summary.exhausted > 0 and summary.approved + summary.exhausted == 600
    decision = ledger(spec, "round-01-decision")
    assert decision["kind"] == "exhausted" and "max_rounds" in decision["reason"]
    exhausted = list(JsonlDir(str(Path(spec.output) / spec.run / "exhausted")).iter_records_sync())
    assert len(exhausted) == summary.exhausted and all(r["status"] == "exhausted" for r in exhausted)
    assert summary.conservation["ok"]


@pytest.mark.parametrize("kind", ["infer", "judge"])
async def test_a_permanently_failing_shard_is_quarantined_and_the_round_completes(make_spec, kind: str) -> None:
    spec = make_spec(approval=0.5, max_rounds=3)
    async with open_runner(spec) as pool:
        where = "sharded" if kind == "infer" else "round-00/inferred"
        runner = FailingShardRunner(pool, shard_name=f"{where}/part-00002.jsonl.zst", kind=kind)
        summary = await run_pipeline(spec, runner=runner)
    assert summary.status == "quarantined"
    assert summary.failed == 100  # the whole shard, in the round it failed
    assert summary.approved + summary.exhausted + summary.failed == 600
    assert summary.conservation["ok"]
    phase = ledger(spec, f"round-00-{kind}")
    (entry,) = phase["quarantined"]
    assert entry["phase"] == kind and entry["records"] == 100 and "device lost" in entry["error"]
    assert entry["shard"].endswith("part-00002.jsonl.zst")
    failed_dir = Path(spec.output) / spec.run / "round-00" / "failed"
    assert [p.name for p in failed_dir.iterdir()] == [f"{kind}-part-00002.jsonl"]
    # the other nine shards of the round went through both phases
    assert ledger(spec, "round-00-judge")["records_in"] == 500
    assert runner.calls["failed"] == 1  # quarantined, never requeued in later rounds
    # the id sources finalize checked, as Dagster's whole-run checks get them
    sources = PipelineRun(spec).terminal_sources()
    assert [s.state for s in sources] == ["input", "approved", "exhausted", "unfinished", "failed", "failed"]
    assert sources[-1].urls == (entry["shard"],) and not sources[-1].is_dir
    assert len(sources[-2].urls) == summary.rounds


async def test_a_quarantined_task_that_had_committed_its_outputs_leaves_none_behind(make_spec) -> None:
    """A task that failed after committing output (its last retry's report lost): the shard's
    records count as failed, so none of its output shards may count too."""
    spec = make_spec(approval=0.5, max_rounds=2)
    left: dict[str, bool] = {}

    class CommittedThenFailed(CountingRunner):
        async def run_task(self, task: TaskSpec) -> TaskResult:
            result = await super().run_task(task)
            if task.kind == "infer" and task.input_url.endswith("sharded/part-00002.jsonl.zst"):
                left.update({url: JsonlFile(url).exists_sync() for url in task.output_files()})
                raise TaskFailed(task, ["OSError: device lost"])
            return result

    async with open_runner(spec) as pool:
        summary = await run_pipeline(spec, runner=CommittedThenFailed(pool))
    assert left and all(left.values())  # committed before it failed
    assert not any(JsonlFile(url).exists_sync() for url in left)
    assert summary.status == "quarantined" and summary.failed == 100 and summary.conservation["ok"]


async def test_resumed_run_does_not_redo_finished_shards(make_spec) -> None:
    spec = make_spec(approval=0.5, records=1000, max_rounds=2, pool={"concurrency": 2})
    progress = Path(spec.output) / spec.run / "ledger" / "progress" / "round-00-infer"
    async with open_runner(spec) as pool:
        first = CountingRunner(pool)
        task = asyncio.create_task(run_pipeline(spec, runner=first))
        while not progress.exists() or len(list(progress.iterdir())) < 3:
            await asyncio.sleep(0.005)
        task.cancel()  # the driver stops mid-phase (as Ctrl-C does)
        with pytest.raises(asyncio.CancelledError):
            await task
    done_before = {p.name for p in progress.iterdir()}
    assert 3 <= len(done_before) < 10
    async with open_runner(spec) as pool:
        second = CountingRunner(pool)
        summary = await run_pipeline(spec, runner=second)
    redone = [t for t in second.task_ids if "/r00/infer/" in t]
    assert len(redone) == 10 - len(done_before)
    assert not {f"part-{t.rsplit('/', 1)[1]}.json" for t in redone} & done_before
    assert summary.conservation["ok"] and summary.conservation["duplicate_results"] == 0
    # a third run of a finished pipeline dispatches nothing at all
    async with open_runner(spec) as pool:
        third = CountingRunner(pool)
        again = await run_pipeline(spec, runner=third)
    assert sum(third.calls.values()) == 0 and again.approved == summary.approved


async def test_round_conservation_failure_names_the_shard(make_spec) -> None:
    class LosingJudge(CountingRunner):
        """A judge that reports one record fewer than it read (a lost record)."""

        async def run_task(self, spec: TaskSpec) -> TaskResult:
            result = await super().run_task(spec)
            if spec.kind == "judge" and spec.input_url.endswith("part-00001.jsonl.zst"):
                counts = {**result.counts, "approved": result.counts["approved"] - 1}
                return result.model_copy(update={"counts": counts})
            return result

    spec = make_spec()
    async with open_runner(spec) as pool:
        run = PipelineRun(spec, LosingJudge(pool))
        await run.shard()
        await run.infer(0)
        with pytest.raises(ConservationError, match=r"round 0: approved \+ rejected != inferred.*round-00/inferred/part-00001"):
            await run.judge(0)


async def test_finalize_catches_duplicates_in_results(make_spec) -> None:
    spec = make_spec(approval=0.9, max_rounds=1)
    await run_pipeline(spec)
    results = Path(spec.output) / spec.run / "results"
    first = sorted(results.iterdir())[0]
    (results / "round-09-part-00000.jsonl.zst").write_bytes(first.read_bytes())  # a shard written twice
    (Path(spec.output) / spec.run / "ledger" / "run.json").unlink()
    with pytest.raises(ConservationError, match="duplicated in results") as err:
        await PipelineRun(spec).finalize()
    assert err.value.details["duplicate_results"] > 0


async def test_ids_assigned_and_duplicate_input_ids_reported(tmp_path: Path, make_spec) -> None:
    src = tmp_path / "dups.jsonl"
    src.write_bytes(b"".join(orjson.dumps({"id": f"x{i % 50}", "prompt": f"p{i}"}) + b"\n" for i in range(60)))
    spec = make_spec(input=str(src), approval=1.0, max_rounds=1)
    summary = await run_pipeline(spec)
    shard = ledger(spec, "shard")
    assert shard["duplicate_ids"] == 10 and shard["ids_assigned"] == 0
    assert summary.approved == 60 and summary.conservation["ok"]  # duplicates kept, not merged
    spec2 = make_spec(run="no-ids", approval=1.0, max_rounds=1)
    await run_pipeline(spec2)
    assert ledger(spec2, "shard")["ids_assigned"] == 600
    assert "storage_options" in ledger(spec2, "spec")


async def test_pipeline_steps_never_block_the_event_loop_on_storage(make_spec, monkeypatch) -> None:
    """Ledger reads/writes and shard listings run off the loop the in-process pool's batcher
    shares (on S3 each is a network round trip): every step of a hybrid run, rounds and tail."""
    import asyncio
    import traceback

    from batch_inference.pipeline.ledger import Ledger
    from batch_inference.storage import JsonlDir, JsonlFile

    on_loop: list[str] = []

    def watch(cls, name):
        real = getattr(cls, name)

        def wrapper(*args, **kwargs):
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                pass  # a worker thread: fine
            else:
                on_loop.append(f"{cls.__name__}.{name}\n" + "".join(traceback.format_stack(limit=6)))
            return real(*args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    for cls, name in [(Ledger, "read_url"), (Ledger, "write_url"), (JsonlDir, "manifest"), (JsonlDir, "shards"),
                      (JsonlDir, "exists_sync"), (JsonlFile, "exists_sync")]:
        watch(cls, name)
    spec = make_spec(strategy="hybrid", approval=0.3, max_rounds=2, max_attempts=4, records=300)
    summary = await run_pipeline(spec)
    assert summary.tail and summary.conservation["ok"]
    resumed = await run_pipeline(spec)  # the resume path reads every step's ledger entry
    assert resumed.approved == summary.approved
    assert on_loop == [], on_loop[0]


async def test_permanent_record_errors_count_as_failed_in_the_round_they_failed(tmp_path: Path, make_spec) -> None:
    """Records with a permanent error (here a missing template field) fail in round 0: its
    row (view, CLI table) says failed 2, not rejected, and every round's failed adds up to
    the run's (the Dagster funnel: defs/test_units.py)."""
    from rich.console import Console

    from batch_inference.pipeline.report import ledger_table

    src = tmp_path / "input.jsonl"
    rows = [{"id": f"p{i:03d}", "prompt": f"q {i}"} for i in range(200)]
    rows[50], rows[150] = {"id": "p050", "question": "no prompt"}, {"id": "p150", "question": "no prompt"}  # past the preflight
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    spec = make_spec(approval=0.7, max_rounds=4, max_attempts=10)
    summary = await run_pipeline(spec)
    assert summary.failed == 2 and summary.conservation["ok"]
    view = PipelineRun(spec).ledger.view()
    r0, r1 = view.rounds[0], view.rounds[1]
    assert r0.failed == 2 and r0.approved + r0.rejected + r0.failed == r0.records_in == 200
    assert r1.records_in == r0.rejected  # what round 0 rejected, without the failed
    assert sum(r.failed for r in view.rounds) == summary.failed
    console = Console(width=200, record=True)
    console.print(ledger_table(view, "t"))
    row = next(line for line in console.export_text().splitlines() if "round 0" in line)
    cells = [c.strip() for c in row.split("│")]
    assert cells[2:6] == ["200", str(r0.approved), str(r0.rejected), "2"], row


async def test_a_shard_quarantined_by_an_interrupted_call_that_succeeds_on_rerun_loses_its_entry(make_spec) -> None:
    """The infer step quarantined shard 2 but its ledger entry never got written (the driver
    died): the re-run runs shard 2 again, and once it succeeds its old entry is gone, so its
    records are not counted failed as well as inferred."""
    spec = make_spec(approval=1.0)
    run_dir = Path(spec.output) / spec.run
    async with open_runner(spec) as pool:
        await PipelineRun(spec).shard()
        failing = FailingShardRunner(pool, shard_name="sharded/part-00002.jsonl.zst", kind="infer")
        assert len((await PipelineRun(spec, failing).infer(0)).quarantined) == 1
        (run_dir / "ledger" / "round-00-infer.json").unlink()
        again = await PipelineRun(spec, CountingRunner(pool)).infer(0)
    assert again.quarantined == [] and again.shards_run == 1 and again.records_in == 600
    assert list((run_dir / "round-00" / "failed").iterdir()) == []


async def test_a_round_whose_rejected_rows_all_failed_permanently_is_the_last(tmp_path: Path, make_spec) -> None:
    """Nothing is left to retry when every rejected row has a permanent error: the run ends
    after that round (no round of zero records), and the failed rows reach failed-records."""
    src = tmp_path / "input.jsonl"
    rows = [{"id": f"p{i:03d}", "prompt": f"q {i}"} for i in range(100)]
    rows[10], rows[60] = {"id": "p010", "question": "no prompt"}, {"id": "p060", "question": "no prompt"}
    src.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    spec = make_spec(approval=1.0, max_rounds=3)
    summary = await run_pipeline(spec)
    assert (summary.status, summary.rounds, summary.approved, summary.failed) == ("records_failed", 1, 98, 2)
    assert summary.conservation["ok"]
    decision = PipelineRun(spec).ledger.view().rounds[0].decision
    assert decision.kind == "done" and decision.figures["failed"] == 2 and decision.figures["rejected"] == 0


def _shard_committed(spec) -> bool:
    return (Path(spec.output) / spec.run / "ledger" / "shard.json").exists()


async def test_the_shard_step_runs_while_the_pool_opens(make_spec, monkeypatch) -> None:
    """The shard step (reshard, layout pass) is the driver's CPU work before the first task;
    the pool's start (workers spawning, models loading) is the pool's. A run pays the longer
    of the two, not their sum: a pool that takes a while to open finds the shard step done."""
    import batch_inference.pipeline.runner as runner_mod

    real = runner_mod.open_runner
    seen: list[bool] = []

    @contextlib.asynccontextmanager
    async def slow_open(spec):
        async with real(spec) as runner:
            for _ in range(200):  # the pool "loads its model" for up to 4 s
                if _shard_committed(spec):
                    break
                await asyncio.sleep(0.02)
            seen.append(_shard_committed(spec))
            yield runner

    monkeypatch.setattr(runner_mod, "open_runner", slow_open)
    spec = make_spec(approval=1.0)
    summary = await run_pipeline(spec)
    assert seen == [True], "the shard step waited for the pool to open"
    assert summary.status == "converged" and summary.approved == 600 and summary.conservation["ok"]


async def test_a_pool_that_fails_to_open_fails_the_run_with_its_own_error(make_spec, monkeypatch) -> None:
    """The shard step beside a pool that cannot open: the run fails with the pool's error (not
    the shard step's, nor a cancellation), the shard step is left finished rather than half
    written, and a re-run resumes from it."""
    import batch_inference.pipeline.runner as runner_mod

    real = runner_mod.open_runner

    @contextlib.asynccontextmanager
    async def broken_open(spec):
        raise RuntimeError("no node has a free GPU")
        yield  # pragma: no cover

    monkeypatch.setattr(runner_mod, "open_runner", broken_open)
    spec = make_spec(approval=1.0)
    with pytest.raises(RuntimeError, match="no node has a free GPU"):
        await run_pipeline(spec)
    assert _shard_committed(spec)
    shard_instance = ledger(spec, "shard")["instance"]

    monkeypatch.setattr(runner_mod, "open_runner", real)
    summary = await run_pipeline(spec)
    assert summary.status == "converged" and summary.approved == 600 and summary.conservation["ok"]
    assert ledger(spec, "shard")["instance"] == shard_instance  # resumed, not resharded


async def test_a_shard_step_that_fails_stops_the_pool_opening_and_fails_the_run_at_once(make_spec, monkeypatch) -> None:
    """Bad input found by the shard step is reported then, not after the pool's start (minutes
    of model loading, or a Kubernetes pool's ready timeout): the opening is cancelled."""
    import time

    import batch_inference.pipeline.runner as runner_mod
    from batch_inference.pipeline.resume import Resume

    cancelled: list[bool] = []

    @contextlib.asynccontextmanager
    async def slow_open(spec):
        try:
            await asyncio.sleep(60)  # a pool that takes a minute to load its model
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        yield None  # pragma: no cover

    async def bad_shard(self, feed=None):
        await asyncio.sleep(0.05)
        raise ValueError("input.jsonl:7: not a record")

    monkeypatch.setattr(runner_mod, "open_runner", slow_open)
    monkeypatch.setattr(Resume, "shard", bad_shard)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="input.jsonl:7"):
        await run_pipeline(make_spec())
    assert time.monotonic() - t0 < 20 and cancelled == [True]


async def test_a_caller_s_cancel_while_the_pool_opens_stays_a_cancel(make_spec, monkeypatch) -> None:
    """Ctrl-C (the caller cancelling the run) while the pool opens is a cancellation, and the
    shard step, already under way, is let finish its writing."""
    import batch_inference.pipeline.runner as runner_mod

    @contextlib.asynccontextmanager
    async def slow_open(spec):
        await asyncio.sleep(60)
        yield None  # pragma: no cover

    monkeypatch.setattr(runner_mod, "open_runner", slow_open)
    spec = make_spec()
    task = asyncio.create_task(run_pipeline(spec))
    for _ in range(200):
        await asyncio.sleep(0.05)
        if _shard_committed(spec):
            break
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _shard_committed(spec)
