"""A pipeline run on a simulated cluster, in discrete-event time: minutes for 100M records.

The decisions are the pipeline's own code: shard tasks go through ``dispatch_bounded``
(at most replicas x concurrency in flight), the round after a judge phase is chosen by
``decide_round`` (the hybrid's ``choose_crossover`` included) from ``PhaseSummary``
figures built exactly as the ledger's are, rejected records are recompacted into full
shards, and a task that fails (a preempted replica) is retried elsewhere up to
``retries`` times and then quarantined, as ``PoolClient`` does. What is simulated is the
world around them: records are counts, not rows; each replica's engine is the
decode-step model's throughput (``engines.decode_model``), shared by its running tasks
(processor sharing: finished tasks leave their share to the others); storage, Dagster
and Kubernetes are per-task and per-phase latencies (``Overheads``); spot preemption is a
Poisson process per replica.

Time is virtual: ``VirtualClockLoop`` is an asyncio loop whose clock jumps to the next
timer instead of sleeping, so the real async code runs unchanged and a 100M-record run
takes seconds. The planner (``pipeline.plan``) runs the same simulation for a spec.
"""

from __future__ import annotations

import asyncio
import math
import random
import selectors
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

from batch_inference.engines.decode_model import (
    DecodeProfile,
    draw_output_tokens,
    record_rng,
    run_blocking,
    run_continuous,
    token_budget_batches,
)
from batch_inference.pipeline.crossover import expected_attempts
from batch_inference.pipeline.run import decide_round
from batch_inference.pipeline.spec import PipelineSpec
from batch_inference.pipeline.summaries import Decision, PhaseSummary
from batch_inference.pool.dispatch import dispatch_bounded

T = TypeVar("T")


# -- virtual time ------------------------------------------------------------------


class _JumpSelector(selectors.BaseSelector):
    """Never waits: a select with a timeout moves the loop's clock forward by it."""

    def __init__(self) -> None:
        self._map: dict[Any, selectors.SelectorKey] = {}
        self.loop: VirtualClockLoop | None = None

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, fileobj if isinstance(fileobj, int) else fileobj.fileno(), events, data)
        self._map[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._map.pop(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise RuntimeError("simulation deadlock: every task waits and no timer is set")
        assert self.loop is not None
        self.loop.now += max(0.0, timeout)
        return []

    def get_map(self) -> Any:
        return self._map

    def close(self) -> None:
        self._map.clear()


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock: ``asyncio.sleep(3600)`` returns at once, an hour later.

    Only timers and ready callbacks exist here: no threads, no sockets (a coroutine that
    waits on real I/O is a deadlock and raises).
    """

    def __init__(self) -> None:
        selector = _JumpSelector()
        self.now = 0.0
        super().__init__(selector)
        selector.loop = self

    def time(self) -> float:
        return self.now


def run_virtual(main: Callable[[], Awaitable[T]]) -> T:
    """Run ``main()`` to completion on a fresh ``VirtualClockLoop``."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


# -- the model's inputs ------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """What is being run: record count, token shapes, the judge, the approval rate."""

    records: int = 100_000_000
    prompt_tokens: float = 220.0  # mean, geometric
    output_tokens: float = 134.0  # mean before the cap
    output_lengths: Literal["fixed", "geometric", "pareto"] = "geometric"
    max_tokens: int = 256
    judge_extra_tokens: int = 30  # the judge template around prompt + result
    judge_prompt_tokens: float | None = None  # when known (the planner counts it): replaces prompt + output + extra
    judge_output_tokens: int = 4
    approval: float = 0.9  # P(approved) per attempt, independent across attempts


@dataclass(frozen=True)
class Overheads:
    """Latencies around the engine. Defaults: S3 in-region, Dagster on Kubernetes.

    ``task_s``: one shard task's storage round trips (open and first byte of its input,
    the multipart upload and commit of its output, its progress record), half before its
    first record reaches the engine and half after its last. ``driver_task_s``: the
    driver's own work per task on its one event loop (serialised). ``phase_launch_s``:
    a Dagster run and its step pod (``k8s_job_executor``) before a phase dispatches.
    ``round_gap_s``: the round sensor's tick before the next step is requested.
    ``list_page_s``: one S3 LIST of 1,000 objects. Recompaction is one serial pass over
    the rejected records (read + zstd write, ``recompact_records_per_s``, the storage
    floors measured here) plus ``object_s`` per shard written. ``restart_s``: a preempted
    replica's replacement (node, pod, model load).
    """

    task_s: float = 0.4
    driver_task_s: float = 0.005
    phase_launch_s: float = 45.0
    round_gap_s: float = 30.0
    list_page_s: float = 0.1
    recompact_records_per_s: float = 110_000.0
    object_s: float = 0.3
    reshard_records_per_s: float = 110_000.0
    restart_s: float = 180.0
    checkpoint_interval_s: float = 5.0
    retries: int = 3
    backoff_s: float = 0.5


@dataclass(frozen=True)
class EngineRates:
    """Engine-seconds per record at saturation (one replica), from the decode model."""

    infer_s: float
    judge_s: float
    infer_latency_s: float  # one record's decode: the latency chain a task ends with
    judge_latency_s: float
    infer_tokens_out: float  # mean output tokens per record
    steps_per_record: float  # engine steps (continuous) or calls (blocking) per inferred record
    calls_per_record: float  # what one blocking generate() per token-budgeted batch would take
    scheduling: str
    profile: str
    tail_attempt_s: float = 0.0  # one in-place record-attempt when measured (else infer + judge)

    @property
    def per_attempt_s(self) -> float:
        return self.tail_attempt_s or (self.infer_s + self.judge_s)


def engine_rates(
    profile: DecodeProfile,
    workload: Workload,
    *,
    scheduling: Literal["continuous", "blocking"] = "continuous",
    target_batch_tokens: int = 12_800,
    max_batch_size: int = 256,
    sample: int = 20_000,
) -> EngineRates:
    """Measure the workload on the decode model (a sample of records, virtual time)."""
    w = workload
    infer = []
    judge = []
    for i in range(sample):
        p = draw_output_tokens(record_rng("plan", "p", i), "geometric", w.prompt_tokens, max_tokens=1 << 20)
        o = draw_output_tokens(record_rng("plan", "o", i), w.output_lengths, w.output_tokens, max_tokens=w.max_tokens)
        infer.append((p, o))
        jp = round(w.judge_prompt_tokens) if w.judge_prompt_tokens is not None else p + o + w.judge_extra_tokens
        judge.append((max(1, jp), w.judge_output_tokens))
    budget = token_budget_batches(infer, target_tokens=target_batch_tokens, max_tokens=w.max_tokens, max_batch_size=max_batch_size)
    if scheduling == "continuous":
        ri = run_continuous(profile, infer, max_in_flight=2 * profile.max_num_seqs)
        rj = run_continuous(profile, judge, max_in_flight=2 * profile.max_num_seqs)
        steps = ri.steps / sample
    else:
        ri = run_blocking(profile, budget)
        rj = run_blocking(profile, token_budget_batches(judge, target_tokens=target_batch_tokens,
                                                        max_tokens=w.judge_output_tokens, max_batch_size=max_batch_size))
        steps = len(budget) / sample
    step_i = ri.seconds / max(1, ri.steps)
    step_j = rj.seconds / max(1, rj.steps)
    mean_out = sum(o for _, o in infer) / sample
    return EngineRates(
        infer_s=ri.seconds / sample, judge_s=rj.seconds / sample,
        infer_latency_s=step_i * mean_out, judge_latency_s=step_j * w.judge_output_tokens,
        infer_tokens_out=mean_out, steps_per_record=steps, calls_per_record=len(budget) / sample,
        scheduling=scheduling, profile=profile.name,
    )


@dataclass(frozen=True)
class Cluster:
    replicas: int = 32
    concurrency: int = 10
    preemptions_per_gpu_hour: float = 0.0
    seed: int = 0


# -- the simulated cluster -----------------------------------------------------------------


class Preempted(Exception):
    """The replica running the task was preempted; ``done_s``/``rate`` say how far it got."""

    def __init__(self, done_s: float, rate: float) -> None:
        super().__init__("replica preempted")
        self.done_s = done_s
        self.rate = rate


class TaskQuarantined(Exception):
    """A task exhausted its retries."""


@dataclass
class _Job:
    remaining_s: float
    future: asyncio.Future[None]
    done_s: float = 0.0


class Replica:
    """One GPU worker: ``concurrency`` slots over one engine shared by its running jobs."""

    def __init__(self, sim: ClusterSim, index: int) -> None:
        self.sim = sim
        self.index = index
        self.up = True
        self.slots = 0  # tasks holding a slot (in storage latency or on the engine)
        self.jobs: list[_Job] = []
        self.busy_s = 0.0  # engine-seconds of work done (useful or later redone)
        self.up_s = 0.0
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def _advance(self) -> None:
        now = self.sim.loop.time()
        dt = now - self._last
        self._last = now
        if dt <= 0:
            return
        if self.up:
            self.up_s += dt
        if self.jobs:
            share = dt / len(self.jobs)
            for job in self.jobs:
                job.remaining_s -= share
                job.done_s += share
            self.busy_s += dt

    def _reschedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.jobs:
            soonest = min(j.remaining_s for j in self.jobs)
            self._timer = self.sim.loop.call_later(max(0.0, soonest) * len(self.jobs), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._advance()
        for job in [j for j in self.jobs if j.remaining_s <= 1e-9]:
            self.jobs.remove(job)
            job.future.set_result(None)
        self._reschedule()

    async def work(self, work_s: float) -> None:
        """Run ``work_s`` engine-seconds on this replica's shared engine."""
        self._advance()
        job = _Job(work_s, self.sim.loop.create_future())
        self.jobs.append(job)
        self._reschedule()
        try:
            await job.future
        except asyncio.CancelledError:
            self._advance()
            if job in self.jobs:
                self.jobs.remove(job)
            self._reschedule()
            raise

    def preempt(self) -> None:
        self._advance()
        rate = 1.0 / max(1, len(self.jobs))
        for job in self.jobs:
            job.future.set_exception(Preempted(job.done_s, rate))
        self.jobs = []
        self._reschedule()
        self.up = False

    def restore(self) -> None:
        self._advance()
        self.up = True


@dataclass
class PhaseResult:
    summary: PhaseSummary
    engine_s: float
    redone_s: float
    quarantined_records: int


class ClusterSim:
    """The replicas, their slots, preemption, and the task runner the phases dispatch to."""

    def __init__(self, cluster: Cluster, overheads: Overheads, loop: asyncio.AbstractEventLoop) -> None:
        self.cluster = cluster
        self.overheads = overheads
        self.loop = loop
        self.replicas = [Replica(self, i) for i in range(cluster.replicas)]
        self.rng = random.Random(cluster.seed)
        self._slot_free = asyncio.Condition()
        self._driver = asyncio.Lock()
        self.redone_s = 0.0
        self.preemptions = 0
        self.retries = 0
        self._chaos: list[asyncio.Task[None]] = []

    @property
    def limit(self) -> int:
        return self.cluster.replicas * self.cluster.concurrency

    def start(self) -> None:
        if self.cluster.preemptions_per_gpu_hour > 0:
            self._chaos = [self.loop.create_task(self._preemptions(r)) for r in self.replicas]

    async def stop(self) -> None:
        for t in self._chaos:
            t.cancel()
        await asyncio.gather(*self._chaos, return_exceptions=True)
        for r in self.replicas:
            r._advance()

    async def _preemptions(self, replica: Replica) -> None:
        rate_per_s = self.cluster.preemptions_per_gpu_hour / 3600.0
        while True:
            await asyncio.sleep(self.rng.expovariate(rate_per_s))
            replica.preempt()
            self.preemptions += 1
            await asyncio.sleep(self.overheads.restart_s)
            replica.restore()
            async with self._slot_free:
                self._slot_free.notify_all()

    async def _acquire(self) -> Replica:
        async with self._slot_free:
            while True:
                free = [r for r in self.replicas if r.up and r.slots < self.cluster.concurrency]
                if free:
                    best = min(free, key=lambda r: (r.slots, r.index))  # least loaded, as PoolClient picks
                    best.slots += 1
                    return best
                await self._slot_free.wait()

    async def _release(self, replica: Replica) -> None:
        replica.slots -= 1
        async with self._slot_free:
            self._slot_free.notify_all()

    async def run_task(self, work_s: float, *, latency_s: float, sample_level: bool) -> float:
        """One shard task: storage latency, its engine work, its drain; retried on preemption.

        ``sample_level``: resume from the last checkpoint (in-place retry) instead of
        redoing the shard (rounds). Returns the task's wall.
        """
        o = self.overheads
        start = self.loop.time()
        failures = 0
        remaining = work_s
        async with self._driver:  # the driver's own bookkeeping is serial
            await asyncio.sleep(o.driver_task_s)
        while True:
            replica = await self._acquire()
            try:
                await asyncio.sleep(o.task_s / 2)
                if not replica.up:
                    raise Preempted(0.0, 0.0)
                await replica.work(remaining)
                await asyncio.sleep(latency_s + o.task_s / 2)
                if not replica.up:
                    raise Preempted(0.0, 0.0)
                return self.loop.time() - start
            except Preempted as p:
                if sample_level:
                    lost = min(p.done_s, o.checkpoint_interval_s * p.rate)
                    remaining = remaining - p.done_s + lost
                else:
                    lost = p.done_s
                    remaining = work_s
                self.redone_s += lost
                failures += 1
                if failures > o.retries:
                    raise TaskQuarantined(f"preempted {failures} times") from p
                self.retries += 1
            finally:
                await self._release(replica)
            await asyncio.sleep(min(10.0, o.backoff_s * 2 ** (failures - 1)))

    def engine_busy_s(self) -> float:
        for r in self.replicas:
            r._advance()
        return sum(r.busy_s for r in self.replicas)


# -- a whole run ------------------------------------------------------------------------------


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
    gpu_s: float  # replicas x wall: what is paid for
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
) -> SimResult:
    """Simulate ``spec`` (strategy, max_rounds/attempts, crossover, shard_records) at scale.

    ``phases="one_round"`` stops after round 0's infer and judge (the capacity math).
    """
    cluster = cluster or Cluster(replicas=spec.pool.replicas, concurrency=spec.pool.concurrency)
    overheads = overheads or Overheads(retries=spec.pool.retries)
    return run_virtual(lambda: _simulate(spec, workload, rates, cluster, overheads, phases))


async def _simulate(spec: PipelineSpec, w: Workload, rates: EngineRates, cluster: Cluster, o: Overheads,
                    phases: str) -> SimResult:
    loop = asyncio.get_running_loop()
    sim = ClusterSim(cluster, o, loop)
    sim.start()
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
                    latency_s: float, *, sample_level: bool = False, attempts_per_record: float = 1.0) -> PhaseResult:
        nonlocal quarantined
        await asyncio.sleep(o.phase_launch_s + o.list_page_s * math.ceil(len(shards) / 1000))
        t0 = loop.time()
        busy0, redone0 = sim.engine_busy_s(), sim.redone_s
        longest = 0.0
        done_records = 0
        lost: list[dict[str, Any]] = []
        retries0 = sim.retries

        async def one(n: int) -> tuple[int, float]:
            return n, await sim.run_task(n * per_record_s * attempts_per_record, latency_s=latency_s, sample_level=sample_level)

        def ok(res: tuple[int, float]) -> None:
            nonlocal longest, done_records
            longest = max(longest, res[1])
            done_records += res[0]

        def failed(n: int, exc: BaseException) -> None:
            if not isinstance(exc, TaskQuarantined):
                raise exc
            lost.append({"shard": f"sim://{name}", "phase": name, "records": n, "error": str(exc), "round": r})

        await dispatch_bounded(shards, one, ok, failed, limit=sim.limit)
        wall = loop.time() - t0
        engine = sim.engine_busy_s() - busy0
        quarantined += sum(q["records"] for q in lost)
        if name != "tail":
            attempts[name] += done_records
        summary = PhaseSummary(
            round=r, phase=name, input_url="sim://", output_url="sim://", shards=len(shards), shards_run=len(shards),
            records_in=done_records, counts={}, tokens_in=0, tokens_out=0, engine_busy_s=engine, wall_s=wall,
            drain_s=0.0, avg_fill=0.0, cached_tasks=0, task_retries=sim.retries - retries0,
            longest_task_s=longest, quarantined=lost, workers=cluster.replicas,
        )
        rounds.append(RoundRecord(f"round {r} {name}" if name != "tail" else "tail", done_records, len(shards),
                                  wall + o.phase_launch_s, engine, o.phase_launch_s))
        return PhaseResult(summary, engine, sim.redone_s - redone0, sum(q["records"] for q in lost))

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
    pending = _shards(w.records, shard_n)
    approved_total = 0
    unfinished = 0
    tail_from: int | None = 0 if spec.strategy == "in_place" else None
    r = 0
    last_recompact_s = 0.0
    waves = len(pending) / sim.limit
    while tail_from is None:
        inf = await phase(r, "infer", pending, rates.infer_s, rates.infer_latency_s)
        judged = [n for n in pending]  # quarantined infer shards' records are lost to the round
        judged_records = inf.summary.records_in
        if inf.quarantined_records:
            judged = _shards(judged_records, shard_n)
        jud = await phase(r, "judge", judged, rates.judge_s, rates.judge_latency_s)
        approved = split(jud.summary.records_in, w.approval)
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
        e = expected_attempts(w.approval, k)
        records = sum(pending)
        tail = await phase(tail_from, "tail", pending, rates.per_attempt_s, k * (rates.infer_latency_s + rates.judge_latency_s) / 2,
                           sample_level=True, attempts_per_record=e)
        done = tail.summary.records_in
        ok = split(done, 1 - (1 - w.approval) ** k) if k > 0 else 0
        approved_total += ok
        unfinished = done - ok + (records - done - tail.quarantined_records)
        attempts["infer"] += done * e
        attempts["judge"] += done * e
    await asyncio.sleep(o.phase_launch_s)  # results + finalize
    rounds.append(RoundRecord("results + finalize", approved_total, 0, o.phase_launch_s, 0.0, o.phase_launch_s))
    wall = loop.time() - t_start
    await sim.stop()
    engine = sim.engine_busy_s()
    return SimResult(
        strategy=spec.strategy, wall_s=wall, engine_s=engine, gpu_s=(loop.time() - t_gpu) * cluster.replicas,
        approved=approved_total, unfinished=unfinished, quarantined=quarantined, waves=waves,
        redone_s=sim.redone_s, preemptions=sim.preemptions, retries=sim.retries,
        model_calls=attempts["infer"] * rates.calls_per_record, engine_steps=attempts["infer"] * rates.steps_per_record,
        tokens_out=attempts["infer"] * rates.infer_tokens_out, attempts=attempts["infer"], rounds=rounds, decisions=decisions,
    )
