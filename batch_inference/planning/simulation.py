"""A pipeline run on a simulated cluster, in discrete-event time: minutes for 100M records.

The decisions are the pipeline's own code: shard tasks go through ``dispatch_bounded``
(at most replicas x concurrency in flight), the round after a judge phase is chosen by
``pipeline.policy.decide_round`` (the hybrid's crossover included) from ``PhaseSummary``
figures built exactly as the ledger's are, rejected records are recompacted into full
shards, and a task that fails (a preempted replica) is retried elsewhere up to
``retries`` times and then quarantined, as ``PoolClient`` does. What is simulated is the
world around them: records are counts, not rows; each replica's engine runs at the
engine-rate model's figures (``planning.rates``, from ``engines.decode_model``) on the
simulated cluster (``planning.cluster``).

Time is virtual (``planning.clock``), so the real async code runs unchanged and a
100M-record run takes seconds. The planner (``planning.plan``) runs the same simulation
for a spec.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from batch_inference.pipeline.policy import decide_round
from batch_inference.pipeline.spec import PipelineSpec
from batch_inference.pipeline.summaries import Decision, PhaseSummary
from batch_inference.planning.clock import run_virtual
from batch_inference.planning.cluster import Cluster, ClusterSim, Overheads, TaskQuarantined
from batch_inference.planning.rates import EngineRates, Workload
from batch_inference.pool.dispatch import dispatch_bounded
from batch_inference.pool.constants import TAIL_CHUNKS_IN_FLIGHT


@dataclass
class PhaseResult:
    summary: PhaseSummary
    engine_s: float
    redone_s: float
    quarantined_records: int


@dataclass
class RoundRecord:
    name: str
    records: int
    shards: int
    wall_s: float
    engine_s: float
    overhead_s: float  # launch, listing, recompaction: time the GPUs idle by design
    decision: str = ""


@dataclass
class SimResult:
    strategy: str
    wall_s: float
    engine_s: float  # engine-seconds of work (all replicas)
    gpu_s: float  # replicas x wall: what is paid for (both pools when the judge has its own)
    approved: int
    unfinished: int
    quarantined: int
    waves: float
    redone_s: float
    preemptions: int
    retries: int
    model_calls: float
    engine_steps: float
    tokens_out: float
    attempts: float = 0.0  # inference attempts (records inferred, each time)
    # per pool when the judge has its own: {"infer": {...}, "judge": {...}} with each pool's
    # replicas, gpu_s (replicas x wall from the first phase) and engine_s
    pools: dict[str, dict[str, float]] = field(default_factory=dict)
    rounds: list[RoundRecord] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)

    @property
    def busy_share(self) -> float:
        return self.engine_s / self.gpu_s if self.gpu_s else 0.0

    @property
    def idle_share(self) -> float:
        return 1.0 - self.busy_share

    def gpu_hours(self) -> float:
        return self.gpu_s / 3600.0


def wave_priced(per_record_s: float, call_s: float, calls_per_record: float, waves: float, attempts: float,
                *, merged: float) -> float:
    """Per record-attempt cost of the tail's waves, from ``per_record_s`` priced at full batches.

    ``per_record_s`` carries ``call_s`` (one engine call's fixed cost) over full batches
    (``calls_per_record``); the tail's ``attempts`` record-attempts of a chunk go through
    ``waves`` waves, ``merged`` of which share a call, so its calls are those (never fewer
    than full batches hold): the same work, with each call's fixed cost over that wave.
    """
    if call_s <= 0 or attempts <= 0:
        return per_record_s
    calls = max(waves / max(1.0, merged), attempts * calls_per_record)
    return per_record_s + call_s * (calls / attempts - calls_per_record)


LAYOUT_PHASE = "layout pass (driver CPU, GPUs idle)"  # its phase's name in a plan (planning.progress reads it back)


def layout_parts_s(spec: PipelineSpec, records: int, o: Overheads) -> tuple[float, float]:
    """The shard step's layout pass over ``records`` (``layout.prefix`` on): (its part spread
    over ``layout_workers`` processes, the driver's merge and rewrite)."""
    if not spec.layout.prefix:
        return 0.0, 0.0
    return records * o.layout_record_s / max(1, o.layout_workers), records * o.layout_serial_record_s


def _shards(records: int, shard_records: int) -> list[int]:
    full, rest = divmod(records, shard_records)
    return [shard_records] * full + ([rest] if rest else [])


def simulate(
    spec: PipelineSpec,
    workload: Workload,
    rates: EngineRates,
    *,
    cluster: Cluster | None = None,
    overheads: Overheads | None = None,
    phases: Literal["all", "one_round"] = "all",
    judge_cluster: Cluster | None = None,
    judge_rates: EngineRates | None = None,
    stream_round0: bool | None = None,
) -> SimResult:
    """Simulate ``spec`` (strategy, max_rounds/attempts, crossover, shard_records) at scale.

    ``stream_round0`` (None: ``layout.stream``): round 0's infer phase starts on the layout
    pass's rewritten shards as they come (``pipeline.stream``: a whole run driven by one
    process; Dagster's steps run the shard step first): every GPU waits through the pass's
    spread part, its first wave once the rewrite has written that many shards, and each
    shard after as the rewrite writes it.

    ``phases="one_round"`` stops after round 0's infer and judge (the capacity math).
    ``judge_cluster`` (a judge with its own model and pool): the judge phases run there
    at ``judge_rates.judge_s``, and a tail task does its generation on the infer pool and
    its judge waves on the judge pool at once when its shard has more than one chunk: a
    retry task keeps ``TAIL_CHUNKS_IN_FLIGHT`` chunks in flight, the next generating while
    the one before is judged (pool.retry), so its judging starts once its first chunk's
    first generation is done and then runs beside its generation; the task ends when both
    parts have. A one-chunk shard's parts take turns (bench/reports/judge_model.md
    measures both).
    """
    cluster = cluster or Cluster(replicas=spec.pool.replicas, concurrency=spec.pool.concurrency)
    overheads = overheads or Overheads(retries=spec.pool.retries)
    streams = (spec.layout.stream if stream_round0 is None else stream_round0) and spec.strategy != "in_place"
    return run_virtual(lambda: _simulate(spec, workload, rates, cluster, overheads, phases, judge_cluster, judge_rates or rates,
                                         streams))


async def _simulate(spec: PipelineSpec, w: Workload, rates: EngineRates, cluster: Cluster, o: Overheads,
                    phases: str, judge_cluster: Cluster | None = None, judge_rates: EngineRates | None = None,
                    streams: bool = False) -> SimResult:
    loop = asyncio.get_running_loop()
    sim = ClusterSim(cluster, o, loop)
    sim.start()
    judge_sim = ClusterSim(judge_cluster, o, loop) if judge_cluster is not None else sim
    if judge_sim is not sim:
        judge_sim.start()
    jr = judge_rates or rates
    rng = random.Random(cluster.seed + 1)
    rounds: list[RoundRecord] = []
    decisions: list[Decision] = []
    attempts = {"infer": 0.0, "judge": 0.0}
    quarantined = 0

    async def idle(name: str, seconds: float, records: int, shards: int) -> None:
        t0 = loop.time()
        await asyncio.sleep(seconds)
        rounds.append(RoundRecord(name, records, shards, loop.time() - t0, 0.0, loop.time() - t0))

    async def phase(r: int, name: Literal["infer", "judge", "tail"], shards: list[int], per_record_s: float,
                    latency_s: float, *, sample_level: bool = False, attempts_per_record: float = 1.0,
                    judge_per_record_s: float = 0.0, written_every_s: float = 0.0) -> PhaseResult:
        """``judge_per_record_s``: a tail's judge waves on the judge's own pool (beside its generation).
        ``written_every_s``: the shards come from the layout pass's rewrite, one this often (the
        first wave taken whole once written, as ``ShardFeed.take`` does)."""
        nonlocal quarantined
        pool = judge_sim if name == "judge" else sim
        reads = o.progress_read_s * len(shards) if name == "judge" else 0.0  # the infer phase's progress records
        await asyncio.sleep(o.phase_launch_s + o.list_page_s * math.ceil(len(shards) / 1000) + reads)
        t0 = loop.time()
        busy0, redone0 = pool.engine_busy_s(), pool.redone_s
        longest = 0.0
        done_records = 0
        lost: list[dict[str, Any]] = []
        retries0 = pool.retries

        async def one(n: int) -> tuple[int, float]:
            work = pool.run_task(n * per_record_s * attempts_per_record, latency_s=latency_s, sample_level=sample_level)
            if not judge_per_record_s:
                return n, await work
            judge_work = n * judge_per_record_s * attempts_per_record
            chunk = min(n, spec.chunk_size)
            if TAIL_CHUNKS_IN_FLIGHT < 2 or chunk >= n:  # one chunk: its waves take turns
                infer_wall = await work
                return n, infer_wall + await judge_sim.run_task(judge_work, latency_s=0.0, sample_level=sample_level)
            # the first chunk's first generation (its engine time, unloaded) before any judging
            fill = chunk * per_record_s

            async def waves() -> float:
                await asyncio.sleep(fill)
                return fill + await judge_sim.run_task(judge_work, latency_s=0.0, sample_level=sample_level)

            infer_wall, judge_wall = await asyncio.gather(work, waves())
            return n, max(infer_wall, judge_wall)

        def ok(res: tuple[int, float]) -> None:
            nonlocal longest, done_records
            longest = max(longest, res[1])
            done_records += res[0]

        def failed(n: int, exc: BaseException) -> None:
            if not isinstance(exc, TaskQuarantined):
                raise exc
            lost.append({"shard": f"sim://{name}", "phase": name, "records": n, "error": str(exc), "round": r})

        async def written() -> AsyncIterator[int]:
            wave = min(len(shards), pool.limit)
            for k, n in enumerate(shards):
                ready = t0 + (max(k, wave - 1) + 1) * written_every_s
                if ready > loop.time():
                    await asyncio.sleep(ready - loop.time())
                yield n

        await dispatch_bounded(written() if written_every_s > 0 else shards, one, ok, failed, limit=pool.limit)
        wall = loop.time() - t0
        engine = pool.engine_busy_s() - busy0
        quarantined += sum(q["records"] for q in lost)
        if name != "tail":
            attempts[name] += done_records
        summary = PhaseSummary(
            round=r, phase=name, input_url="sim://", output_url="sim://", shards=len(shards), shards_run=len(shards),
            records_in=done_records, counts={}, tokens_in=0, tokens_out=0, engine_busy_s=engine, wall_s=wall,
            drain_s=0.0, avg_fill=0.0, cached_tasks=0, task_retries=pool.retries - retries0,
            longest_task_s=longest, quarantined=lost, workers=pool.cluster.replicas,
        )
        rounds.append(RoundRecord(f"round {r} {name}" if name != "tail" else "tail", done_records, len(shards),
                                  wall + o.phase_launch_s, engine, o.phase_launch_s))
        return PhaseResult(summary, engine, pool.redone_s - redone0, sum(q["records"] for q in lost))

    def split(records: int, p: float) -> int:
        # a binomial draw, normal-approximated at scale (exact below 1,000)
        if records < 1000:
            return sum(rng.random() < p for _ in range(records))
        return max(0, min(records, round(rng.gauss(records * p, math.sqrt(records * p * (1 - p))))))

    t_start = loop.time()
    shard_n = spec.shard_records
    await idle("shard (reshard input, CPU)", w.records / o.reshard_records_per_s + o.object_s * math.ceil(w.records / shard_n) / 10,
               w.records, math.ceil(w.records / shard_n))
    t_gpu = loop.time()  # the GPU pool is held from here (resharding is CPU work before it)
    spread_s, rewrite_s = layout_parts_s(spec, w.records, o)
    pending = _shards(w.records, shard_n)
    written_every_s = 0.0
    if streams and rewrite_s > 0:  # every GPU waits through the spread part; round 0 starts on the rewrite's shards
        await asyncio.sleep(spread_s)
        rounds.append(RoundRecord(LAYOUT_PHASE, w.records, len(pending), spread_s + rewrite_s, 0.0, spread_s))
        written_every_s = rewrite_s / len(pending)
    elif spread_s + rewrite_s > 0:  # the pool is open: every GPU waits through the layout pass
        await idle(LAYOUT_PHASE, spread_s + rewrite_s, w.records, len(pending))
    approved_total = 0
    unfinished = 0
    tail_from: int | None = 0 if spec.strategy == "in_place" else None
    r = 0
    last_recompact_s = 0.0
    waves = len(pending) / sim.limit
    while tail_from is None:
        inf = await phase(r, "infer", pending, rates.infer_s, rates.infer_latency_s, written_every_s=written_every_s)
        written_every_s = 0.0
        judged = [n for n in pending]  # quarantined infer shards' records are lost to the round
        judged_records = inf.summary.records_in
        if inf.quarantined_records:
            judged = _shards(judged_records, shard_n)
        jud = await phase(r, "judge", judged, jr.judge_s, jr.judge_latency_s)
        approved = split(jud.summary.records_in, w.approval if r == 0 else w.later_approval)
        rejected = jud.summary.records_in - approved
        approved_total += approved
        jud = replace(jud, summary=replace(jud.summary, counts={"approved": approved, "rejected": rejected}))
        if phases == "one_round":
            unfinished = rejected
            break
        decision = decide_round(spec, r, inf.summary, jud.summary, recompact_s=last_recompact_s)
        decisions.append(decision)
        rounds[-1].decision = f"{decision.kind}: {decision.reason}"
        if decision.kind in ("done", "exhausted"):
            unfinished = rejected
            break
        # recompact: one serial pass over the rejected records into full shards
        t0 = loop.time()
        await idle(f"round {r} recompact", o.round_gap_s + o.list_page_s * math.ceil(len(judged) / 1000)
                   + rejected / o.recompact_records_per_s + o.object_s * math.ceil(rejected / shard_n), rejected,
                   math.ceil(rejected / shard_n))
        last_recompact_s = loop.time() - t0
        pending = _shards(rejected, shard_n)
        r += 1
        if decision.kind == "tail":
            tail_from = r
    if tail_from is not None:
        k = spec.max_attempts - tail_from
        e, p_ok = w.attempts(k, first=tail_from == 0)
        records = sum(pending)
        latency = k * (rates.infer_latency_s + jr.judge_latency_s) / 2
        chunk = max(1, min(spec.chunk_size, shard_n))
        waves_per_chunk = w.tail_waves(k, chunk, first=tail_from == 0)
        if judge_sim is sim:
            # One engine: every busy slot's task has its next wave waiting on it while a batch
            # runs, so the batcher merges up to that many waves a batch (a task's own generate
            # and judge waves take turns, never share one).
            merged = min(cluster.concurrency, math.ceil(len(pending) / cluster.replicas))
            per_attempt = wave_priced(rates.per_attempt_s, rates.call_s, rates.calls_per_record + rates.judge_calls_per_record,
                                      2 * waves_per_chunk, chunk * e, merged=merged)
            tail = await phase(tail_from, "tail", pending, per_attempt, latency, sample_level=True, attempts_per_record=e)
        else:  # an attempt's in-place overhead (per_attempt_s over infer + judge) on each pool's own part
            f = rates.per_attempt_s / (rates.infer_s + rates.judge_s) if rates.infer_s + rates.judge_s > 0 else 1.0
            # Two pools: a task's waves alternate between them, so each wave is a call of its own:
            # an upper bound (bench/reports/judge_model.md: 1.4-3.3 waves a call measured, the
            # batcher's merging moving with the timing).
            infer_part = wave_priced(f * rates.infer_s, rates.call_s, rates.calls_per_record, waves_per_chunk, chunk * e, merged=1)
            judge_part = wave_priced(f * jr.judge_s, jr.call_s, jr.judge_calls_per_record, waves_per_chunk, chunk * e, merged=1)
            tail = await phase(tail_from, "tail", pending, infer_part, latency, sample_level=True,
                               attempts_per_record=e, judge_per_record_s=judge_part)
        done = tail.summary.records_in
        ok = split(done, p_ok) if k > 0 else 0
        approved_total += ok
        unfinished = done - ok + (records - done - tail.quarantined_records)
        attempts["infer"] += done * e
        attempts["judge"] += done * e
    # results + finalize: a step's launch, then the conservation check over every record (the pool held)
    finalize_s = o.phase_launch_s + (w.records / o.finalize_records_per_s if o.finalize_records_per_s > 0 else 0.0)
    await asyncio.sleep(finalize_s)
    rounds.append(RoundRecord("results + finalize", approved_total, 0, finalize_s, 0.0, finalize_s))
    wall = loop.time() - t_start
    await sim.stop()
    held = loop.time() - t_gpu
    engine = sim.engine_busy_s()
    pools: dict[str, dict[str, float]] = {}
    gpu_s = held * cluster.replicas
    if judge_sim is not sim:
        await judge_sim.stop()
        judge_engine = judge_sim.engine_busy_s()
        pools = {"infer": {"replicas": cluster.replicas, "gpu_s": gpu_s, "engine_s": engine},
                 "judge": {"replicas": judge_sim.cluster.replicas, "gpu_s": held * judge_sim.cluster.replicas, "engine_s": judge_engine}}
        gpu_s += pools["judge"]["gpu_s"]
        engine += judge_engine
    return SimResult(
        strategy=spec.strategy, wall_s=wall, engine_s=engine, gpu_s=gpu_s, pools=pools,
        approved=approved_total, unfinished=unfinished, quarantined=quarantined, waves=waves,
        redone_s=sim.redone_s, preemptions=sim.preemptions, retries=sim.retries,
        model_calls=attempts["infer"] * rates.calls_per_record, engine_steps=attempts["infer"] * rates.steps_per_record,
        tokens_out=attempts["infer"] * rates.infer_tokens_out, attempts=attempts["infer"], rounds=rounds, decisions=decisions,
    )
