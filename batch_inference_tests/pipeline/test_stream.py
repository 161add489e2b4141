"""Round 0 beside the layout pass (``pipeline.stream``): tasks on the first rewritten shards
while the pass still writes, the same results as after it, and a shard step that fails or is
restarted mid-stream loses nothing and counts nothing twice."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from batch_inference.pipeline import PipelineRun, PipelineSpec, run_pipeline
from batch_inference.pipeline.layout import RunLayout
from batch_inference.pipeline.ledger import ConservationError
from batch_inference.pipeline.runner import PoolPair, open_runner
from batch_inference.pipeline.spec import SpecChanged
from batch_inference.pipeline.stream import ShardFeed
from batch_inference.pool.protocol import TaskResult, TaskSpec
from batch_inference.storage import JsonlDir
from batch_inference_tests.faults.helpers import assert_conserved
from batch_inference_tests.pipeline.helpers import CountingRunner, spec_dict

DOCS, QUESTIONS = 20, 10


def _spec(tmp_path: Path, **overrides: Any) -> PipelineSpec:
    """Documents x questions, question-major (out of prefix order: the layout pass rewrites it),
    20 shards of 10 records."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    with open(tmp_path / "input.jsonl", "wb") as f:
        for q in range(QUESTIONS):
            for d in range(DOCS):
                f.write(orjson.dumps({"id": f"d{d:02d}q{q}", "prompt": f"document {d}: " + f"fact {d} is known. " * 30
                                      + f"question {q}?"}) + b"\n")
    return PipelineSpec.parse(spec_dict(tmp_path, shard_records=10, chunk_size=10, max_rounds=2, **overrides))


class WhileSharding(CountingRunner):
    """Notes, for each round-0 infer task, whether the shard step had finished when it was sent."""

    def __init__(self, inner: Any, spec: PipelineSpec) -> None:
        super().__init__(inner)
        self.shard_done = Path(RunLayout(spec.output, spec.run).ledger_file(RunLayout.SHARD))
        self.sent_after_shard: list[bool] = []

    async def run_task(self, spec: TaskSpec) -> TaskResult:
        if spec.kind == "infer" and spec.round == 0:
            self.sent_after_shard.append(self.shard_done.exists())
        return await super().run_task(spec)


@pytest.fixture
def slow_rewrite(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rewritten shard takes 50 ms (the writing thread): a pass that takes a while."""
    real = ShardFeed.committed

    def committed(self: ShardFeed, *args: Any) -> None:
        real(self, *args)
        time.sleep(0.05)

    monkeypatch.setattr(ShardFeed, "committed", committed)


def _outcome(spec: PipelineSpec) -> dict[str, tuple[str, str]]:
    """Every record's terminal state and text, read from storage."""
    layout = RunLayout(spec.output, spec.run)
    out: dict[str, tuple[str, str]] = {}
    for url, state in ((layout.results, "approved"), (layout.exhausted, "exhausted")):
        for rec in JsonlDir(url).iter_records_sync():
            assert rec["id"] not in out, f"{rec['id']} twice"
            out[rec["id"]] = (state, str(rec.get("result")))
    return out


async def test_round_0_starts_on_the_layout_pass_s_first_shards_with_the_same_results(
        tmp_path: Path, inprocess_pool, slow_rewrite: None) -> None:
    spec = _spec(tmp_path / "stream")
    async with inprocess_pool(concurrency=4) as pool:
        runner = WhileSharding(pool, spec)
        summary = await run_pipeline(spec, runner=runner)
    assert summary.conservation["ok"]
    ledger = Path(RunLayout(spec.output, spec.run).ledger)
    shard = orjson.loads((ledger / "shard.json").read_bytes())
    assert shard["layout"]["applied"] and shard["shards"] == len(runner.sent_after_shard) == 20
    assert runner.sent_after_shard[0] is False, "round 0 waited for the whole layout pass"
    assert orjson.loads((ledger / "shard-stream.json").read_bytes())["instance"] == shard["instance"]
    infer = orjson.loads((ledger / "round-00-infer.json").read_bytes())
    assert infer["shards"] == infer["shards_run"] == 20 and infer["records_in"] == DOCS * QUESTIONS

    whole = _spec(tmp_path / "whole", layout={"stream": False})
    async with inprocess_pool(concurrency=4) as pool:
        after = WhileSharding(pool, whole)
        await run_pipeline(whole, runner=after)
    assert all(after.sent_after_shard) and not (Path(RunLayout(whole.output, whole.run).ledger) / "shard-stream.json").exists()
    assert _outcome(spec) == _outcome(whole) and len(_outcome(spec)) == DOCS * QUESTIONS


async def test_a_shard_step_failing_mid_stream_lets_sent_tasks_finish_and_a_rerun_reuses_them(
        tmp_path: Path, inprocess_pool, slow_rewrite: None, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec(tmp_path)
    real = ShardFeed.committed
    fed: list[int] = []

    def failing(self: ShardFeed, *args: Any) -> None:
        fed.append(1)
        if len(fed) == 9:
            raise RuntimeError("the driver's disk went away")
        real(self, *args)

    with monkeypatch.context() as m:
        m.setattr(ShardFeed, "committed", failing)
        async with inprocess_pool(concurrency=4) as pool:
            runner = CountingRunner(pool)
            with pytest.raises(RuntimeError, match="disk went away"):
                await run_pipeline(spec, runner=runner)
    layout = RunLayout(spec.output, spec.run)
    progress = sorted(p.name for p in Path(layout.progress_dir("round-00-infer")).glob("*.json"))
    # every task sent finished and was recorded (the ids say which were sent, should this ever differ)
    assert 0 < len(progress) == runner.calls["infer"] <= 8, (progress, runner.task_ids)
    assert not Path(layout.ledger_file(RunLayout.step_name(0, "infer"))).exists()

    async with inprocess_pool(concurrency=4) as pool:
        rerun = CountingRunner(pool)
        summary = await run_pipeline(spec, runner=rerun)
    assert summary.conservation["ok"]
    infer = orjson.loads(Path(layout.ledger_file(RunLayout.step_name(0, "infer"))).read_bytes())
    assert infer["shards"] == 20 and infer["shards_run"] == 20 - len(progress)  # same instance, same shards: reused
    assert rerun.task_ids[0].split("/")[1] == runner.task_ids[0].split("/")[1]
    assert len(_outcome(spec)) == DOCS * QUESTIONS


async def test_a_restart_after_round_0_began_refuses_other_shard_keys(tmp_path: Path, inprocess_pool,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Shard i of the restarted step must hold the records shard i's finished task read."""
    spec = _spec(tmp_path)

    real = ShardFeed.committed
    calls: list[int] = []

    def once(self: ShardFeed, *args: Any) -> None:
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("killed mid-rewrite")
        real(self, *args)

    with monkeypatch.context() as m:
        m.setattr(ShardFeed, "committed", once)
        async with inprocess_pool(concurrency=4) as pool:
            with pytest.raises(RuntimeError, match="killed mid-rewrite"):
                await run_pipeline(spec, runner=CountingRunner(pool))
    edited = PipelineSpec.parse({**spec.model_dump(mode="json"), "shard_records": 5})
    async with inprocess_pool(concurrency=4) as pool:
        with pytest.raises(SpecChanged, match="round 0 started on shards laid out under other"):
            await run_pipeline(edited, runner=CountingRunner(pool))


async def test_round_0_failing_beside_the_pass_says_so_at_once_and_the_pass_finishes(
        tmp_path: Path, inprocess_pool, slow_rewrite: None, caplog: pytest.LogCaptureFixture) -> None:
    """Round 0's failure is logged when it happens, not once the rewrite ends (hours at
    scale); the pass still finishes writing ``sharded/``, so a rerun reuses it."""
    spec = _spec(tmp_path)
    shard_done = Path(RunLayout(spec.output, spec.run).ledger_file(RunLayout.SHARD))
    said_before_the_pass_ended: list[bool] = []

    class Noting(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "round 0 failed beside the layout pass" in record.getMessage():
                said_before_the_pass_ended.append(not shard_done.exists())

    class Refusing(CountingRunner):
        async def run_task(self, spec: TaskSpec) -> TaskResult:
            if spec.kind == "infer":
                raise RuntimeError("the pool refused the task")
            return await super().run_task(spec)

    handler = Noting()
    logging.getLogger("batch_inference.pipeline.run").addHandler(handler)
    try:
        async with inprocess_pool(concurrency=4) as pool:
            with pytest.raises(RuntimeError, match="refused"):
                await run_pipeline(spec, runner=Refusing(pool))
    finally:
        logging.getLogger("batch_inference.pipeline.run").removeHandler(handler)
    assert said_before_the_pass_ended == [True]
    assert shard_done.exists() and JsonlDir(RunLayout(spec.output, spec.run).sharded).manifest() is not None


class DropsOnce(CountingRunner):
    """A pool whose connection drops once, under the ``nth`` round-0 infer task sent: a
    transient error the run rides out (``drive_retrying``), not a task failure. Notes whether
    the layout pass was still writing then."""

    def __init__(self, inner: Any, spec: PipelineSpec, nth: int = 5) -> None:
        super().__init__(inner)
        self.shard_done = Path(RunLayout(spec.output, spec.run).ledger_file(RunLayout.SHARD))
        self.nth, self.sent, self.dropped, self.mid_stream = nth, 0, False, False

    async def run_task(self, spec: TaskSpec) -> TaskResult:
        if spec.kind == "infer" and spec.round == 0 and not self.dropped:
            self.sent += 1
            if self.sent == self.nth:
                self.dropped, self.mid_stream = True, not self.shard_done.exists()
                raise ConnectionError("connection to the pool reset")
        return await super().run_task(spec)


def _input_ids() -> list[str]:
    return [f"d{d:02d}q{q}" for q in range(QUESTIONS) for d in range(DOCS)]


def _assert_round_0_whole(spec: PipelineSpec) -> None:
    """Round 0's infer phase ran every shard the shard step committed, and every record ended once."""
    ledger = Path(RunLayout(spec.output, spec.run).ledger)
    shard = orjson.loads((ledger / "shard.json").read_bytes())
    infer = orjson.loads((ledger / "round-00-infer.json").read_bytes())
    assert (infer["shards"], infer["records_in"]) == (shard["shards"], DOCS * QUESTIONS) == (20, DOCS * QUESTIONS)
    assert sum(assert_conserved(spec, _input_ids()).values()) == DOCS * QUESTIONS


@pytest.mark.parametrize("strategy", ["rounds", "hybrid"])
async def test_a_transient_error_mid_stream_resumes_round_0_on_every_shard(
        tmp_path: Path, inprocess_pool, slow_rewrite: None, strategy: str) -> None:
    """The retry after a dropped connection reads ``sharded/`` whole: the feed the first attempt
    drained is not read again, so no shard is left out of round 0."""
    spec = _spec(tmp_path, strategy=strategy)
    async with inprocess_pool(concurrency=4) as pool:
        runner = DropsOnce(pool, spec)
        summary = await run_pipeline(spec, runner=runner, backoff_s=0.01)
    assert runner.dropped and runner.mid_stream and summary.conservation["ok"] and summary.records == DOCS * QUESTIONS
    _assert_round_0_whole(spec)


async def test_a_transient_error_mid_stream_with_a_judge_of_its_own_loses_nothing(
        tmp_path: Path, slow_rewrite: None) -> None:
    """The same with the judge on a model and pool of its own (``PoolPair``, as a Batch API
    model with a judge runs)."""
    spec = _spec(tmp_path, judge={"engine": {"kind": "simulated", "seed": 1, "simulated": {
        "approval_rate": 0.5, "latency_a_s": 0.0002, "latency_b_s": 0.0}}})
    async with open_runner(spec) as pair:
        assert isinstance(pair, PoolPair)
        infer = DropsOnce(pair.infer, spec)
        summary = await run_pipeline(spec, runner=PoolPair(infer, pair.judge), backoff_s=0.01)
    assert infer.dropped and infer.mid_stream and summary.conservation["ok"]
    _assert_round_0_whole(spec)


LEFT_OUT = (3, 7, 11, 15)


def _leave_out_of_round_0(spec: PipelineSpec) -> None:
    """What a retry of streamed round 0 recorded before the fix: round-00-infer.json counting
    16 of the 20 shards, the other 4 never run (no progress record, no output)."""
    layout = RunLayout(spec.output, spec.run)
    entry = Path(layout.ledger_file(RunLayout.step_name(0, "infer")))
    recorded = orjson.loads(entry.read_bytes())
    entry.write_bytes(orjson.dumps({**recorded, "shards": 20 - len(LEFT_OUT)}))
    for i in LEFT_OUT:
        Path(layout.progress_file(RunLayout.step_name(0, "infer"), i)).unlink()
        Path(layout.inferred(0), f"part-{i:05d}.jsonl.zst").unlink(missing_ok=True)
        Path(layout.inferred(0), f"part-{i:05d}.jsonl").unlink(missing_ok=True)


class NoJudge(CountingRunner):
    """A pool that loses its judge: the run stops with round 0 inferred and recorded."""

    async def run_task(self, spec: TaskSpec) -> TaskResult:
        if spec.kind == "judge":
            raise RuntimeError("the judge pool is gone")
        return await super().run_task(spec)


async def _stopped_with_round_0_short(spec: PipelineSpec, inprocess_pool: Any) -> None:
    async with inprocess_pool(concurrency=4) as pool:
        with pytest.raises(RuntimeError, match="judge pool is gone"):
            await run_pipeline(spec, runner=NoJudge(pool))
    _leave_out_of_round_0(spec)


async def test_a_rerun_runs_the_shards_a_short_round_0_entry_left_out(
        tmp_path: Path, inprocess_pool, caplog: pytest.LogCaptureFixture) -> None:
    """A run stopped before its judge with round 0 recorded short: the rerun runs the shards
    left out (only those) and every record ends, instead of trusting the entry."""
    spec = _spec(tmp_path)
    await _stopped_with_round_0_short(spec, inprocess_pool)
    class Round0Inputs(CountingRunner):
        def __init__(self, inner: Any) -> None:
            super().__init__(inner)
            self.inputs: list[str] = []

        async def run_task(self, spec: TaskSpec) -> TaskResult:
            if spec.kind == "infer" and spec.round == 0:
                self.inputs.append(spec.input_url.rsplit("/", 1)[-1])
            return await super().run_task(spec)

    async with inprocess_pool(concurrency=4) as pool:
        rerun = Round0Inputs(pool)
        with caplog.at_level(logging.WARNING, logger="batch_inference.pipeline.run"):
            summary = await run_pipeline(spec, runner=rerun)
    assert summary.conservation["ok"]
    assert sorted(rerun.inputs) == [f"part-{i:05d}.jsonl.zst" for i in LEFT_OUT]
    assert "records 16 of the 20 shards" in caplog.text and "part-00003" in caplog.text
    _assert_round_0_whole(spec)


async def test_a_rerun_of_a_round_judged_without_some_shards_fails_naming_them(tmp_path: Path, inprocess_pool) -> None:
    """Once round 0 was judged on a short entry (the judge step judges what infer recorded),
    the round's later steps stand without the shards left out: the rerun fails at once
    naming them and their records, rather than ending in a count of missing ids."""
    spec = _spec(tmp_path)
    await _stopped_with_round_0_short(spec, inprocess_pool)
    async with inprocess_pool(concurrency=4) as pool:
        judged = await PipelineRun(spec, CountingRunner(pool)).judge(0)
        assert judged.shards == 20 - len(LEFT_OUT)
        with pytest.raises(ConservationError, match=r"records 16 of the 20 shards .*4 never ran: .*part-00003.*part-00007"
                                                     r".*part-00011.*part-00015.*40 records have no terminal state"):
            await run_pipeline(spec, runner=CountingRunner(pool))
