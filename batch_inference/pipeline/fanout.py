"""One fan-out of shard tasks: a round's infer or judge phase, or the tail.

A ``Phase`` says what to run (one ``TaskSpec`` per shard), where its progress and
quarantine entries go, and how many records each shard holds; ``FanOut`` runs it: it
skips the shards whose progress record exists (resume), dispatches the rest through the
``TaskRunner`` with ``dispatch_bounded`` (at most ``runner.limit`` in flight), records a
progress record per finished task, quarantines a task that exhausted its retries (never
requeued), samples the engine's occupancy while the tasks run, and sums their results into a
``PhaseSummary``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from batch_inference.engines.blocks import DistinctBlocks
from batch_inference.pipeline.counts import Counts
from batch_inference.pipeline.ledger import Ledger
from batch_inference.pipeline.summaries import PhaseSummary, QuarantineEntry
from batch_inference.pool import dispatch_bounded
from batch_inference.pool.protocol import JUDGE_POOL_OUTPUT, TaskFailed, TaskResult, TaskRunner, TaskSpec
from batch_inference.storage import JsonlFile
from batch_inference.storage.urls import fs_for

log = logging.getLogger(__name__)

Item = tuple[int, JsonlFile]  # shard index, shard


class Reporter(Protocol):
    """Progress callbacks (the CLI draws bars from them); all optional no-ops by default."""

    def phase_started(self, name: str, total_records: int) -> None: ...

    def shard_done(self, name: str, records: int, counts: dict[str, int], tokens_out: int = 0) -> None: ...

    def phase_ended(self, name: str) -> None: ...


class NullReporter:
    def phase_started(self, name: str, total_records: int) -> None:
        pass

    def shard_done(self, name: str, records: int, counts: dict[str, int], tokens_out: int = 0) -> None:
        pass

    def phase_ended(self, name: str) -> None:
        pass


@dataclass(frozen=True)
class Phase:
    """What one fan-out runs: a task per shard of ``items``."""

    round: int
    kind: Literal["infer", "judge", "tail"]
    step: str  # its ledger entry and progress folder (RunLayout.step_name, or "tail")
    items: list[Item]
    records: dict[int, int]  # records per shard index (a quarantined shard's count)
    make_task: Callable[[int, JsonlFile], TaskSpec]
    quarantine_url: Callable[[int], str]  # where shard i's quarantine entry goes
    input_url: str
    output_url: str
    after: Callable[[int, TaskResult], dict[str, Any]] | None = None  # blocking, per finished task (tail split)
    ran_on: dict[str, Any] = field(default_factory=dict)  # pool, model, adapter (PipelineSpec.placement): the summary's

    @property
    def label(self) -> str:
        return "tail" if self.kind == "tail" else f"round {self.round} {self.kind}"


class FanOut:
    """Runs one ``Phase`` to its ``PhaseSummary`` (idempotent: finished shards are skipped)."""

    def __init__(self, phase: Phase, runner: TaskRunner, ledger: Ledger, reporter: Reporter,
                 storage_options: dict[str, Any] | None) -> None:
        self.phase, self.runner, self.ledger, self.reporter = phase, runner, ledger, reporter
        self.storage_options = storage_options
        self.done: dict[int, dict[str, Any]] = {}
        self.quarantined: list[QuarantineEntry] = []
        self._last_start = 0.0
        self._stale: set[str] = set()  # quarantine entries of shards to run, left by an earlier call

    async def run(self, source: AsyncIterable[Item] | None = None, *, total_records: int = 0) -> PhaseSummary:
        """Run the phase; ``source``: its shards as they become ready (round 0 beside the layout
        pass, ``pipeline.stream``), each appended to ``phase.items`` and ``phase.records`` by
        the source before it yields it, ``total_records`` of them in all; else ``phase.items``."""
        phase = self.phase
        streamed = source is not None
        if not streamed:
            self.done = await asyncio.to_thread(self.ledger.progress, phase.step, [i for i, _ in phase.items])
            todo = [it for it in phase.items if it[0] not in self.done]
            self._stale = await asyncio.to_thread(self._quarantined_before, [i for i, _ in todo])
        else:  # which shards a run that started beside an earlier attempt of the step finished
            self.done = await asyncio.to_thread(self.ledger.progress, phase.step, None)
            self._stale = await asyncio.to_thread(self._quarantined_before, None)
            todo = []
        self.reporter.phase_started(phase.label, total_records if streamed else sum(phase.records.values()))
        for rec in self.done.values():  # resumed shards: done before this call, no throughput to show
            self.reporter.shard_done(phase.label, int(rec["records_in"]), rec["counts"])
        retried_before = self.runner.retried
        t0 = self._last_start = time.perf_counter()
        async with OccupancySampler(self.runner) as occupancy:
            await dispatch_bounded(self._not_done(source, todo) if streamed else todo, self._run_one, self._finished,
                                   self._failed, limit=max(1, self.runner.limit))
        if streamed:  # a record of an index the step no longer wrote is not this phase's
            self.done = {i: rec for i, rec in self.done.items() if i in phase.records}
        wall = time.perf_counter() - t0
        self.reporter.phase_ended(phase.label)
        return self._summary(todo, wall=wall, drain=(wall - (self._last_start - t0)) if todo else 0.0,
                             task_retries=self.runner.retried - retried_before, engine=occupancy.figures())

    async def _not_done(self, source: AsyncIterable[Item], todo: list[Item]) -> AsyncIterator[Item]:
        """The source's shards that have no progress record, each added to ``todo`` as it is sent."""
        async for item in source:
            if item[0] not in self.done:
                todo.append(item)
                yield item

    async def _run_one(self, item: Item) -> dict[str, Any]:
        index, shard = item
        self._last_start = time.perf_counter()
        result = await self.runner.run_task(self.phase.make_task(index, shard))
        for warning in result.warnings:
            log.warning("%s shard %s: %s", self.phase.label, shard.url, warning)
        rec = {**result.model_dump(mode="json"), "index": index, "input": shard.url}
        if self.phase.after is not None:
            rec["after"] = await asyncio.to_thread(self.phase.after, index, result)
        if (stale := self.phase.quarantine_url(index)) in self._stale:  # an earlier interrupted call's entry
            await asyncio.to_thread(self._remove, stale)
        await asyncio.to_thread(self.ledger.write_progress, self.phase.step, index, rec)
        return rec

    def _finished(self, rec: dict[str, Any]) -> None:
        self.done[int(rec["index"])] = rec
        self.reporter.shard_done(self.phase.label, int(rec["records_in"]), rec["counts"], tokens_out=int(rec.get("tokens_out", 0)))

    async def _failed(self, item: Item, exc: BaseException) -> None:
        if not isinstance(exc, TaskFailed):
            # Cancellation, Ctrl-C, the driver's own storage failing (e.g. writing the
            # progress record of a task that succeeded), or a TaskConflict (the spec changed
            # under a task id): not the shard's fault, never quarantined; the run stops.
            raise exc
        index, shard = item
        await asyncio.to_thread(self._discard_outputs, exc.spec)
        entry = QuarantineEntry(shard=shard.url, phase=self.phase.kind, error=str(exc),
                                records=self.phase.records.get(index, 0), task_id=exc.spec.task_id, round=self.phase.round)
        # Never requeued: a deterministic failure would loop until max_rounds.
        log.error("quarantined %s shard %s: %s", self.phase.label, shard.url, exc)
        async with self._file(self.phase.quarantine_url(index)).writer() as w:
            await w.write(entry.as_dict())
        self.quarantined.append(entry)
        self.reporter.shard_done(self.phase.label, entry.records, {})

    def _summary(self, todo: list[Item], *, wall: float, drain: float, task_retries: int,
                 engine: dict[str, Any] | None = None) -> PhaseSummary:
        recs = [self.done[i] for i in sorted(self.done)]
        counts = Counts.total(rec["counts"] for rec in recs).as_dict()
        records_in = sum(int(x["records_in"]) for x in recs)
        phase = self.phase
        return PhaseSummary(
            round=phase.round, phase=phase.kind, input_url=phase.input_url, output_url=phase.output_url,
            shards=len(phase.items), shards_run=len(todo), records_in=records_in, counts=counts,
            tokens_in=sum(int(x["tokens_in"]) for x in recs), tokens_out=sum(int(x["tokens_out"]) for x in recs),
            engine_busy_s=sum(float(x["engine_busy_s"]) for x in recs), wall_s=wall, drain_s=drain,
            longest_task_s=max((float(self.done[i]["wall_s"]) for i, _ in todo if i in self.done), default=0.0),
            avg_fill=sum(float(x["avg_fill"]) * int(x["records_in"]) for x in recs) / (records_in or 1),
            cached_tasks=sum(1 for x in recs if x.get("cached")), task_retries=task_retries,
            quarantined=sorted(self.quarantined, key=lambda q: q.shard),
            workers=len({str(x["worker"]) for x in recs}),
            warnings=[w for x in recs for w in x.get("warnings", [])],
            output_tokens_per_s=sum(int(x["tokens_out"]) for x in recs) / wall if wall > 0 else 0.0,
            engine=engine or {},
            ran_on=dict(phase.ran_on),
            duplicates=sum(int(x.get("duplicates", 0)) for x in recs),
            duplicate_tokens_in=sum(int(x.get("duplicate_tokens_in", 0)) for x in recs),
            duplicate_tokens_out=sum(int(x.get("duplicate_tokens_out", 0)) for x in recs),
            prefix_queried=sum(int(x.get("prefix_queried", 0)) for x in recs),
            prefix_hits=sum(int(x.get("prefix_hits", 0)) for x in recs),
            ideal_prefill_tokens=ideal_prefill(recs),
            result_cache_lookups=sum(int(x.get("result_cache_lookups", 0)) for x in recs),
            result_cache_hits=sum(int(x.get("result_cache_hits", 0)) for x in recs),
            engine_requests=sum(int(x.get("engine_requests", 0)) for x in recs),
        )

    def _file(self, url: str) -> JsonlFile:
        return JsonlFile(url, storage_options=self.storage_options)

    def _quarantined_before(self, indices: list[int] | None) -> set[str]:
        """The quarantine entries among ``indices``' that exist (None: every entry in the folder
        shard 0's would be in): one listing per folder, not a lookup per task (on an object
        store, a missing key's lookup is two round trips)."""
        if indices is None:
            folder = self.phase.quarantine_url(0).rsplit("/", 1)[0]
            return {f"{folder}/{n}" for n in self._listed(folder)}
        by_folder: dict[str, list[str]] = {}
        for i in indices:
            url = self.phase.quarantine_url(i)
            by_folder.setdefault(url.rsplit("/", 1)[0], []).append(url)
        found: set[str] = set()
        for folder, urls in by_folder.items():
            names = self._listed(folder)
            found.update(u for u in urls if u.rsplit("/", 1)[-1] in names)
        return found

    def _listed(self, folder: str) -> set[str]:
        """The names in ``folder`` (none when it does not exist), listed afresh."""
        fs, path = fs_for(folder, self.storage_options)
        try:
            fs.invalidate_cache(path)
            return {n.rsplit("/", 1)[-1] for n in fs.ls(path, detail=False)}
        except FileNotFoundError:
            return set()

    def _remove(self, url: str) -> None:
        if (f := self._file(url)).exists_sync():
            f.fs.rm(f.path)

    def _discard_outputs(self, spec: TaskSpec) -> None:
        """A quarantined task's records are all ``failed``: no partial output may count too
        (a tail task's judge waves' scratch folder goes too, whole: it is no shard)."""
        for url in spec.output_files():
            self._remove(url)
        if (waves := spec.outputs.get(JUDGE_POOL_OUTPUT)) is not None:
            fs, path = fs_for(waves, self.storage_options)
            if fs.exists(path):
                fs.rm(path, recursive=True)


def ideal_prefill(recs: list[dict[str, Any]]) -> int | None:
    """Each distinct prefix of the phase computed once: the tasks' block sketches merged
    (their distinct cacheable blocks, over every worker) times the block size, plus every
    request's tokens past its blocks. None when no task's engine keeps a prefix cache."""
    merged: DistinctBlocks | None = None
    size: int | None = None
    tail = 0
    for rec in recs:
        if not rec.get("prefix_blocks") or not rec.get("prefix_block_size"):
            continue
        sketch = DistinctBlocks.from_text(rec["prefix_blocks"])
        size = int(rec["prefix_block_size"])
        tail += int(rec.get("prefix_tail_tokens", 0))
        if merged is None:
            merged = sketch
        else:
            merged.merge(sketch)
    if merged is None or size is None:
        return None
    return merged.estimate() * size + tail


class OccupancySampler:
    """Samples the runner's engine occupancy (``TaskRunner.stats``) while a phase runs.

    Streaming engines report running/waiting requests, in-flight/capacity and KV-cache
    use; the phase records their means (summed over workers; KV use averaged). A
    blocking engine records only the feed mode.
    """

    def __init__(self, runner: Any, interval_s: float = 1.0) -> None:
        self.runner = runner
        self.interval_s = interval_s
        self.samples: list[list[dict[str, Any]]] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> OccupancySampler:
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                stats = await self.runner.stats()
            except Exception:  # noqa: BLE001 - figures only: a worker that does not answer is skipped
                continue
            workers = [w for w in (stats.get("workers") or {}).values() if w] if "workers" in stats else [stats]
            self.samples.append(workers)

    def figures(self) -> dict[str, Any]:
        workers = [w for sample in self.samples for w in sample]
        if not workers:
            return {}
        out: dict[str, Any] = {"mode": "stream" if any(w.get("mode") == "stream" for w in workers) else "batch",
                               "samples": len(self.samples)}
        for key in ("engine_running", "engine_waiting", "in_flight"):
            per_sample = [sum(w[key] for w in sample if w.get(key) is not None) for sample in self.samples
                          if any(w.get(key) is not None for w in sample)]
            if per_sample:
                out[f"mean_{key}"] = round(sum(per_sample) / len(per_sample), 2)
        capacity = [sum(w.get("capacity") or 0 for w in sample) for sample in self.samples]
        if any(capacity):
            out["capacity"] = max(capacity)
        kv = [w["kv_cache_usage"] for w in workers if w.get("kv_cache_usage") is not None]
        if kv:
            out["mean_kv_cache_usage"] = round(sum(kv) / len(kv), 4)
        return out
