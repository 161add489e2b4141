"""The simulated cluster: replicas, their task slots, preemption, and the task runner.

Each replica's engine is shared by its running tasks (processor sharing: finished tasks
leave their share to the others); storage, Dagster and Kubernetes are per-task and
per-phase latencies (``Overheads``); spot preemption is a Poisson process per replica. A
task that fails (a preempted replica) is retried elsewhere up to ``retries`` times and
then quarantined, as ``PoolClient`` does.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Overheads:
    """Latencies around the engine. Defaults: S3 in-region, Dagster on Kubernetes.

    ``task_s``: one shard task's storage round trips (open and first byte of its input,
    the multipart upload and commit of its output, its progress record), half before its
    first record reaches the engine and half after its last. ``driver_task_s``: the
    driver's own work per task (serialised): its progress record's PUT, 11.2 ms at a 20 ms
    round trip (bench/reports/ledger_overhead.md). ``progress_read_s``: per shard, the
    judge step's read of the infer phase's progress records before it dispatches, 5.0 ms
    (same bench). ``phase_launch_s``:
    a Dagster run and its step pod (``k8s_job_executor``) before a phase dispatches.
    ``round_gap_s``: the round sensor's tick before the next step is requested.
    ``list_page_s``: one S3 LIST of 1,000 objects. Recompaction is one serial pass over
    the rejected records (read + zstd write, ``recompact_records_per_s``, the storage
    floors measured here) plus ``object_s`` per shard written. ``restart_s``: a preempted
    replica's replacement (node, pod, model load).

    The shard step's layout pass (``pipeline.placement``, ``layout.prefix`` on) runs on the
    driver after resharding, with the pool already open (every GPU held, idle):
    ``layout_record_s`` per record for the part its passes spread over ``layout_workers``
    processes (reading, rendering, signing by text and by the model's tokens, spilling
    sorted runs), ``layout_serial_record_s`` for the part left in the driver's process
    (merging, counting, rewriting). Both 0: not modelled; ``make_plan`` measures them on its
    sample (``planning.layout_cost``), bench/reports/layout_cost.md at scale.
    """

    task_s: float = 0.4
    driver_task_s: float = 0.0112
    progress_read_s: float = 0.005
    phase_launch_s: float = 45.0
    round_gap_s: float = 30.0
    list_page_s: float = 0.1
    recompact_records_per_s: float = 110_000.0
    object_s: float = 0.3
    reshard_records_per_s: float = 110_000.0
    # the run's finalize: its conservation check streams every input and terminal id through
    # hashed buckets on the driver's local disk, one core, the pool still held
    # (bench/reports/scale_10m.md: 80,000 input records/s at 10M at load ~4, 24,000 inside the run at load ~8,
    # on a shared 2-core machine; 0: not modelled)
    finalize_records_per_s: float = 80_000.0
    layout_record_s: float = 0.0
    layout_serial_record_s: float = 0.0
    layout_workers: int = 1
    restart_s: float = 180.0
    checkpoint_interval_s: float = 5.0
    retries: int = 3
    backoff_s: float = 0.5


@dataclass(frozen=True)
class Cluster:
    replicas: int = 32
    concurrency: int = 10
    preemptions_per_gpu_hour: float = 0.0
    seed: int = 0


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
