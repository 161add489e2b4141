"""A pipeline run as idempotent, resumable steps (docs/ARCHITECTURE.md "pipeline").

``PipelineRun`` holds no state between steps beyond what is in storage: every step reads
its inputs and the ledger, describes its fan-out of shard tasks as a ``fanout.Phase``
(``FanOut`` skips the shards whose progress record says they are done and dispatches the
rest, at most ``runner.limit`` in flight), and records its summary. So the Dagster layer can
call each step from its own process, and a killed driver re-runs into a resume.
``pipeline.driver`` calls the steps in sequence; ``pipeline.one_step`` calls one of them
from outside an event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, Protocol

from batch_inference.pipeline import affinity, passes, placement
from batch_inference.pipeline.fanout import FanOut, Item, NullReporter, Phase, Reporter
from batch_inference.pipeline.layout import RunLayout, part
from batch_inference.pipeline.ledger import ConservationError, IdSource, Ledger, check_conservation
from batch_inference.pipeline.policy import decide_round
from batch_inference.pipeline.resume import Resume
from batch_inference.pipeline.runner import PoolPair
from batch_inference.pipeline.spec import PipelineSpec
from batch_inference.pipeline.stream import ShardFeed, ShardStepStart
from batch_inference.pipeline.summaries import (
    Decision,
    JudgedRound,
    PhaseSummary,
    QuarantineEntry,
    RecompactSummary,
    RunSummary,
    ShardSummary,
    StepOutcome,
)
from batch_inference.pool.result_cache import ResultCache
from batch_inference.pool.protocol import JUDGE_POOL_OUTPUT, REVIEW_OUTPUT, SubmitOrder, TaskResult, TaskRunner, TaskSpec
from batch_inference.prompting.prefix import PrefixSigner
from batch_inference.review import lifecycle as review
from batch_inference.storage import JsonlDir, JsonlFile
from batch_inference.storage.urls import join

log = logging.getLogger(__name__)

__all__ = ["EtaEstimate", "PipelineRun", "Reporter", "StepOrderError"]


class StepOrderError(RuntimeError):
    """A step was called before the step that produces its input."""


class EtaEstimate(Protocol):
    """Seconds a run still needs after round ``r`` was decided (``planning.eta_after_round``)."""

    def __call__(self, spec: PipelineSpec, r: int, infer: PhaseSummary, judge: PhaseSummary, decision_kind: str,
                 *, recompact_s: float = 0.0) -> float: ...


class PipelineRun:
    """The steps of one run. ``runner`` is needed only by ``infer``, ``judge`` and ``tail``.

    ``eta``, when given, adds the run's ETA to each recorded decision; the pipeline does
    not plan, so whoever builds the run (CLI, Dagster steps) passes the planner's estimate.
    """

    def __init__(self, spec: PipelineSpec, runner: TaskRunner | None = None, *, reporter: Reporter | None = None,
                 eta: EtaEstimate | None = None, stream_round0: bool = False) -> None:
        self.spec = spec
        self.runner = runner
        self.reporter: Reporter = reporter or NullReporter()
        self.eta = eta
        self.layout = RunLayout(spec.output, spec.run)
        self.storage_options = spec.storage_options or None
        self.ledger = Ledger(self.layout, spec.storage_options)
        self.resume = Resume(spec, self.layout, self.ledger)
        self._signer_made: PrefixSigner | None = None
        # round 0 may start beside the layout pass (pipeline.stream): set where one process
        # drives the whole run (run_pipeline), never by a step that runs the shard step alone
        self.stream_round0 = stream_round0
        self._shard_start: ShardStepStart | None = None

    # -- helpers --------------------------------------------------------------------

    @property
    def _order(self) -> SubmitOrder:
        """How tasks submit a chunk's requests (``layout.prefix``: sorted, admitted together)."""
        return "prefix" if self.spec.layout.prefix else "input"

    def _dir(self, url: str) -> JsonlDir:
        return JsonlDir(url, storage_options=self.storage_options)

    def _file(self, url: str) -> JsonlFile:
        return JsonlFile(url, storage_options=self.storage_options)

    def _require(self, name: str, hint: str) -> dict[str, Any]:
        data = self.ledger.read(name)
        if data is None:
            raise StepOrderError(f"run {self.spec.run!r}: ledger/{name}.json is missing: {hint}")
        return data

    def _pending_items(self, r: int) -> tuple[list[Item], dict[int, int]]:
        """Round ``r``'s pending shards by index, and their record counts (from the manifest)."""
        d = self._dir(self.layout.pending(r))
        man = d.manifest()
        if man is None:
            step = "shard()" if r == 0 else f"recompact({r - 1})"
            raise StepOrderError(f"run {self.spec.run!r}: {d.url} is not committed yet: run {step} first")
        by_name = {s["name"]: int(s["records"]) for s in man.shards}
        items = list(enumerate(d.shards()))
        return items, {i: by_name.get(f.name, 0) for i, f in items}

    def _fanout(self, phase: Phase) -> FanOut:
        if self.runner is None:
            raise StepOrderError(f"{phase.kind} needs a TaskRunner: PipelineRun(spec, runner)")
        # where it runs, for the ledger; a judge with its own model runs its phase on its own pool (PoolPair)
        phase = replace(phase, ran_on=self.spec.placement(phase.kind))
        runner = self.runner.for_phase(phase.kind) if isinstance(self.runner, PoolPair) else self.runner
        return FanOut(phase, runner, self.ledger, self.reporter, self.storage_options)

    async def _fan_out(self, phase: Phase) -> PhaseSummary:
        return await self._fanout(phase).run()

    # -- step: shard (pipeline.resume) ------------------------------------------------

    async def shard(self) -> ShardSummary:
        """Reshard the input once (CPU): ids assigned where missing, duplicate ids reported.
        A call while the step runs in this process joins it (``run_pipeline`` starts it beside
        the pool's start); else the step runs here, in the caller's task."""
        if (start := self._live_shard_step()) is not None:
            return await asyncio.shield(start.task)
        self._shard_start = None
        return await self.resume.shard()

    def _live_shard_step(self) -> ShardStepStart | None:
        """The shard step started in this process, running or finished, unless it failed."""
        start = self._shard_start
        return None if start is None or start.failed else start

    def start_shard(self) -> asyncio.Future[ShardSummary]:
        """Start the shard step as a task of its own, or join the one started (a new one after
        it failed). With ``stream_round0``, its layout pass feeds round 0 each shard it rewrites
        (``ShardStepStart.feed``, which round 0 takes once)."""
        if (start := self._live_shard_step()) is not None:
            return start.task
        feed = ShardFeed() if self._may_stream() else None
        self._shard_start = ShardStepStart(asyncio.ensure_future(self._shard_step(feed)), feed)
        return self._shard_start.task

    def _may_stream(self) -> bool:
        """Round 0 may start beside the layout pass: a whole run (``stream_round0``), the pass
        on and streaming (``layout.prefix``, ``layout.stream``), a strategy with rounds."""
        s = self.spec
        return self.stream_round0 and s.layout.prefix and s.layout.stream and s.strategy != "in_place"

    @property
    def streams_round0(self) -> bool:
        """Whether the shard step in this process feeds round 0 the shards it lays out (and round
        0 has not taken the feed yet)."""
        return self._shard_start is not None and self._shard_start.feed is not None

    async def _shard_step(self, feed: ShardFeed | None) -> ShardSummary:
        try:
            summary = await self.resume.shard(feed)
        except BaseException as exc:
            if feed is not None:
                feed.end(exc)
            raise
        if feed is not None:
            feed.end()
        return summary

    async def shard_and_infer_first(self) -> None:
        """The shard step, and round 0's infer phase beside it when its layout pass streams
        (``stream_round0``, ``layout.stream``): the GPUs start on the first shards of the
        rewrite instead of waiting through the whole pass. Without a stream, the step alone.

        However round 0 ends, the shard step is waited for before this returns or raises: its
        thread is still writing ``sharded/``, and a retry must not start a second writer.
        """
        if not self._may_stream() and self._live_shard_step() is None:
            await self.shard()  # nothing to stream: the step alone, in this task
            return
        task = self.start_shard()
        if not self.streams_round0 or task.done():
            await asyncio.shield(task)
            return
        try:
            await self.infer(0)
        except BaseException as exc:
            if not task.done():  # said now: the wait below is up to the rest of the rewrite (hours at scale)
                log.error("run %s: round 0 failed beside the layout pass (%s: %s); waiting for the pass to finish "
                          "writing %s, which a rerun then reuses", self.spec.run, type(exc).__name__, exc, self.layout.sharded)
            with contextlib.suppress(BaseException):
                await asyncio.shield(task)
            raise
        await asyncio.shield(task)

    def _signer(self) -> PrefixSigner:
        """The layout's signer: the shard step's, recompaction's and the dispatch's (its
        tokenizer loaded once a run)."""
        if self._signer_made is None:
            self._signer_made = self.resume.signer()
        return self._signer_made

    def _layout_common(self, signer: PrefixSigner) -> int | None:
        """The blocks every input record shares, as the shard step's layout pass counted them
        with this signer (None: no pass, or one that signed otherwise; blocking)."""
        laid = (self.ledger.read(RunLayout.SHARD) or {}).get("layout") or {}
        if laid.get("signature") != signer.tokenizer.name or laid.get("block_size") != signer.block_size:
            return None
        return int(laid.get("common_blocks", 0))

    def _family_cuts(self) -> placement.FamilyCuts | None:
        """How recompaction cuts its shards: between families when the shard step laid the
        records out in prefix order (the rejected records keep that order), else by count
        (records in input order: no family sits together to keep whole; blocking)."""
        if not self.spec.layout.prefix:
            return None
        shard = self.ledger.read(RunLayout.SHARD) or {}
        if not (shard.get("layout") or {}).get("applied"):
            return None
        signer = self._signer()
        return placement.FamilyCuts(signer, self.spec.request_infer, common=self._layout_common(signer) or 0)

    def _instance(self) -> str:
        """The run instance every task id of this run carries (drawn at sharding); every
        step that sends tasks asks for it, so each also checks the spec it resumes under."""
        instance = str(self._require(RunLayout.SHARD, "run shard() first").get("instance", ""))
        self.resume.check_spec()
        return instance

    def _routes_by_family(self) -> bool:
        """Whether tasks carry their shard's prefix family: a pool of several workers with
        affinity on; not in process, where one engine serves every task."""
        pool = self.spec.pool
        return pool.affinity and not (pool.launcher == "inprocess" and not pool.endpoints)

    def _families(self, items: list[Item]) -> dict[int, str]:
        """Each shard's prefix family for a pool of several workers (``pipeline.affinity``,
        with the layout's signer and the layout's common prefix; blocking); none in
        process, where one engine serves every task, or with it off."""
        if not self._routes_by_family():
            return {}
        signer = self._signer()
        return affinity.shard_families(items, self.spec.request_infer, signer, common=self._layout_common(signer))

    def _dedup_scope(self, r: int, kind: str, instance: str) -> str | None:
        """The phase within which identical requests run once (None: the spec turned it off)."""
        return self.layout.phase_key(r, kind, instance=instance) if self.spec.dedup else None

    def _phase_done(self, name: str) -> PhaseSummary | None:
        data = self.ledger.read(name)
        return PhaseSummary.from_dict(data) if data is not None else None

    # -- step: infer ----------------------------------------------------------------

    async def infer(self, r: int) -> PhaseSummary:
        """pending(r) -> inferred(r), one output shard per pending shard."""
        name = self.layout.step_name(r, "infer")
        if (done := await asyncio.to_thread(self._infer_recorded, r, name)) is not None:
            return done
        if r == 0 and (start := self._shard_start) is not None and (feed := start.take_feed()) is not None:
            await feed.first()
            if feed.streaming and (streamed := await self._infer_streamed(name, feed)) is not None:
                return streamed
            if feed.error is not None:
                raise feed.error
        items, records = await asyncio.to_thread(self._pending_items, r)
        instance = await asyncio.to_thread(self._instance)
        families = await asyncio.to_thread(self._families, items)
        summary = await self._fan_out(self._infer_phase(r, name, items, records, instance, families))
        await asyncio.to_thread(self.ledger.write, name, summary.as_dict())
        return summary

    def _infer_phase(self, r: int, name: str, items: list[Item], records: dict[int, int], instance: str,
                     families: dict[int, str]) -> Phase:
        def make(index: int, shard: JsonlFile) -> TaskSpec:
            return TaskSpec(
                task_id=self.layout.task_id(r, "infer", index, instance=instance), kind="infer", input_url=shard.url,
                affinity=families.get(index),
                outputs={"output": join(self.layout.inferred(r), part(index))}, infer=self.spec.request_infer,
                chunk_size=self.spec.chunk_size, round=r, storage_options_ref=self.spec.pool.storage_options_ref, order=self._order,
                result_cache=self.spec.result_cache_url, dedup_scope=self._dedup_scope(r, "infer", instance),
                progress_url=self.layout.live_progress_file(name, index),
            )

        return Phase(
            round=r, kind="infer", step=name, items=items, records=records, make_task=make,
            quarantine_url=lambda i: self.layout.failed_entry(r, "infer", i),
            input_url=self.layout.pending(r), output_url=self.layout.inferred(r),
        )

    def _infer_recorded(self, r: int, name: str) -> PhaseSummary | None:
        """infer(r)'s ledger entry, if it covers every shard of pending(r) (blocking).

        An entry short of shards with some never run (what a retry of streamed round 0 once
        recorded, reading the feed its first attempt had drained) is not trusted: while the
        round is not judged yet, None, so the phase runs the shards left out (those finished
        are skipped); once judged, the round's later steps stand without them, and this fails
        naming them."""
        done = self._phase_done(name)
        if done is None:
            return None
        pending = self._dir(self.layout.pending(r))
        man = pending.manifest()
        if man is None or done.shards == len(man.shards):
            return done
        shards = pending.shards()
        ran = self.ledger.progress(name, list(range(len(shards))))
        never_ran = [f for i, f in enumerate(shards)
                     if i not in ran and not self._file(self.layout.failed_entry(r, "infer", i)).exists_sync()]
        if not never_ran:
            return done
        per_shard = {s["name"]: int(s["records"]) for s in man.shards}
        lost = sum(per_shard.get(f.name, 0) for f in never_ran)
        named = ", ".join(f.url for f in never_ran[:10]) + (" ..." if len(never_ran) > 10 else "")
        told = (f"run {self.spec.run!r}: {self.layout.ledger_file(name)} records {done.shards} of the {len(shards)} shards of "
                f"{pending.url}; {len(never_ran)} never ran: {named}")
        if self.ledger.read(self.layout.step_name(r, "judge")) is None:
            log.warning("%s; running them now", told)
            return None
        raise ConservationError(
            f"{told}, and round {r} was judged without them, so their {lost} records have no terminal state. "
            f"Give the spec a new `run` name, or delete {self.layout.root} to start over.",
            {"never_ran": [f.url for f in never_ran], "records": lost})

    async def _infer_streamed(self, name: str, feed: ShardFeed) -> PhaseSummary | None:
        """Round 0's infer phase on each shard as the layout pass commits it (``pipeline.stream``):
        the same tasks as after the pass, dispatched while its merge and rewrite go on. Its
        ledger entry is written once the shard step has finished and committed exactly the
        shards it streamed, and every one of them ran (else None, with nothing recorded: the
        caller runs the rest from ``sharded/``); a shard step that fails ends the dispatch, and
        its error is raised once what was sent has finished."""
        items: list[Item] = []
        records: dict[int, int] = {}
        families: dict[int, str] = {}
        signer = self._signer() if self._routes_by_family() else None
        sharded = self.layout.sharded
        fanout = self._fanout(self._infer_phase(0, name, items, records, feed.instance, families))

        async def ready() -> AsyncIterator[Item]:
            wave = max(1, fanout.runner.limit)  # the first wave whole, then each shard as it comes
            while batch := await feed.take(wave):
                wave = 1
                fresh = [(fed.index, self._file(join(sharded, fed.name))) for fed in batch]
                if signer is not None:  # the blocks every record so far shares stand for the final count
                    families.update(await asyncio.to_thread(
                        affinity.shard_families, fresh, self.spec.request_infer, signer, common=batch[-1].common))
                for fed, item in zip(batch, fresh):  # no await between them: the pool places them together
                    items.append(item)
                    records[fed.index] = fed.records
                    yield item

        summary = await fanout.run(ready(), total_records=feed.total_records)
        if feed.error is not None:
            raise feed.error
        await asyncio.to_thread(self._check_streamed, feed)
        quarantined = {q.shard for q in fanout.quarantined}
        ran = set(fanout.done) | {i for i, shard in items if shard.url in quarantined}
        if left := [fed.name for fed in feed.fed if fed.index not in ran]:
            log.warning("run %s: round 0 ran %d of the %d shards the layout pass streamed; running %s from %s",
                        self.spec.run, len(ran), len(feed.fed), ", ".join(left[:10]), self.layout.sharded)
            return None
        await asyncio.to_thread(self.ledger.write, name, summary.as_dict())
        return summary

    def _check_streamed(self, feed: ShardFeed) -> None:
        """The shards round 0 ran on are the ones the shard step committed (blocking)."""
        man = self._dir(self.layout.sharded).manifest()
        committed = [(s["name"], int(s["records"])) for s in man.shards] if man is not None else None
        if committed != [(f.name, f.records) for f in feed.fed]:
            raise StepOrderError(f"run {self.spec.run!r}: round 0 ran on {len(feed.fed)} shards of {self.layout.sharded} as the "
                                 f"layout pass wrote them, but the shard step committed {committed and len(committed)}")

    # -- step: judge ----------------------------------------------------------------

    async def judge(self, r: int) -> PhaseSummary:
        """inferred(r) -> results (approved) + rejected(r); checks approved + rejected == inferred."""
        name = self.layout.step_name(r, "judge")
        if (done := await asyncio.to_thread(self._phase_done, name)) is not None:
            return done
        infer_step = self.layout.step_name(r, "infer")
        await asyncio.to_thread(self._require, infer_step, f"run infer({r}) first")
        indices = await asyncio.to_thread(self._all_indices, r)
        inferred = await asyncio.to_thread(self.ledger.progress, infer_step, indices)
        items = [(i, self._file(join(self.layout.inferred(r), part(i)))) for i in sorted(inferred)]
        written = {i: int(rec["records_in"]) for i, rec in inferred.items()}
        instance = await asyncio.to_thread(self._instance)
        families = await asyncio.to_thread(self._families, items)

        def make(index: int, shard: JsonlFile) -> TaskSpec:
            outputs = {"approved": self.layout.approved_shard(r, index), "rejected": join(self.layout.rejected(r), part(index))}
            if self.spec.judge.reviews:
                outputs[REVIEW_OUTPUT] = join(self.layout.review_queue(r), part(index))
            return TaskSpec(
                task_id=self.layout.task_id(r, "judge", index, instance=instance), kind="judge", input_url=shard.url,
                affinity=families.get(index),
                outputs=outputs,
                judge=self.spec.judge.task_config(), infer=self.spec.request_infer, chunk_size=self.spec.chunk_size, round=r,
                storage_options_ref=self.spec.pool.storage_options_ref, order=self._order, result_cache=self.spec.result_cache_url, dedup_scope=self._dedup_scope(r, "judge", instance),
                progress_url=self.layout.live_progress_file(name, index),
            )

        fan = self._fanout(Phase(
            round=r, kind="judge", step=name, items=items, records=written, make_task=make,
            quarantine_url=lambda i: self.layout.failed_entry(r, "judge", i),
            input_url=self.layout.inferred(r), output_url=self.layout.rejected(r),
        ))
        summary = await fan.run()
        self._check_round(r, written, fan.done)  # the progress records the fan-out holds: no second read
        if summary.counts.get(REVIEW_OUTPUT, 0):
            await asyncio.to_thread(review.open_queue, self.ledger, r, summary.counts[REVIEW_OUTPUT])
        await asyncio.to_thread(self.ledger.write, name, summary.as_dict())
        return summary

    def _all_indices(self, r: int) -> list[int]:
        man = self._dir(self.layout.pending(r)).manifest()
        return list(range(len(man.shards))) if man else []

    def _check_round(self, r: int, inferred: dict[int, int], judged: dict[int, dict[str, Any]]) -> None:
        """approved + rejected (+ awaiting review) == inferred for every judged shard (``judged``: the
        judge's progress records by shard index), or fail naming the shards."""
        bad = []
        for i, rec in judged.items():
            c = rec["counts"]
            split = int(c.get("approved", 0)) + int(c.get("rejected", 0)) + int(c.get(REVIEW_OUTPUT, 0))
            if split != inferred[i] or int(rec["records_in"]) != inferred[i]:
                waiting = f", awaiting review {c.get(REVIEW_OUTPUT, 0)}" if REVIEW_OUTPUT in c else ""
                bad.append(f"{join(self.layout.inferred(r), part(i))} (inferred {inferred[i]}, approved {c.get('approved', 0)}, "
                           f"rejected {c.get('rejected', 0)}{waiting})")
        if bad:
            terms = "approved + rejected + awaiting review" if self.spec.judge.reviews else "approved + rejected"
            raise ConservationError(f"run {self.spec.run!r} round {r}: {terms} != inferred for shard(s): " + "; ".join(bad), {"shards": bad})

    # -- step: human review -----------------------------------------------------------

    def needs_review(self, r: int) -> bool:
        """Whether judge(r) sent records to people (sync, cheap: the ledger)."""
        judge = self.ledger.read_as(self.layout.step_name(r, "judge"), PhaseSummary)
        return bool(judge and judge.counts.get(REVIEW_OUTPUT, 0))

    def review_status(self, r: int, *, now: float | None = None) -> review.ReviewStatus:
        """Round ``r``'s review: done, left, by reviewer, age, whether it can close (blocking, sensor-safe)."""
        return review.status(self.spec, self.layout, self.ledger, r, now=now)

    async def resolve_review(self, r: int, *, now: float | None = None) -> review.ReviewSummary:
        """Close round ``r``'s review once its queue is empty or its timeout policy decides the rest.

        Raises :class:`review.ReviewPending` while records wait.
        """
        return await asyncio.to_thread(review.resolve, self.spec, self.layout, self.ledger, r, now=now)

    async def wait_for_review(self, r: int) -> review.ReviewSummary:
        """Poll (``review.poll_s``) until round ``r``'s review can close, then close it.

        Each look goes to the reporter too (``review_waiting(r, text, url)``, optional): the CLI
        prints "waiting for review (N left)". A close that reopens the round (an undo landed
        as it began) is waited on again.
        """
        said = None
        while True:
            st = await asyncio.to_thread(self.review_status, r)
            if st.resolved or st.resolvable:
                try:
                    return await self.resolve_review(r)
                except review.ReviewPending as exc:
                    log.info("run %s round %d: %s", self.spec.run, r, exc)
                    await asyncio.sleep(self.spec.review.poll_s)
                    continue
            if st.text != said:
                log.info("run %s round %d: %s (review page: `batch-inference review`)", self.spec.run, r, st.text)
                said = st.text
            if (waiting := getattr(self.reporter, "review_waiting", None)) is not None:
                waiting(r, st.text, self.spec.review.url)
            await asyncio.sleep(self.spec.review.poll_s)

    def round_counts(self, r: int) -> dict[str, int]:
        """Every count of round ``r``, streamed from its shards (blocking); quarantine from the ledger.

        ``awaiting`` is the review queue while the review is open; once it is resolved the
        reviewed rows count in ``approved`` / ``rejected`` instead, so
        inferred = approved + rejected + awaiting + judge_quarantined at every moment.
        """
        def files(url: str) -> list[JsonlFile]:
            d = self._dir(url)
            return d.shards() if d.exists_sync() else []

        def count(fs: list[JsonlFile]) -> int:
            return sum(sum(1 for _ in f.iter_records_sync()) for f in fs)

        resolved = self.ledger.read(review.ledger_resolved(r)) is not None
        prefix, reviewed = self.layout.approved_prefix(r), self.layout.reviewed_prefix(r)
        infer = self.ledger.read_as(self.layout.step_name(r, "infer"), PhaseSummary)
        judge = self.ledger.read_as(self.layout.step_name(r, "judge"), PhaseSummary)
        return {
            "pending": count(files(self.layout.pending(r))),
            "inferred": count(files(self.layout.inferred(r))),
            "approved": count([f for f in files(self.layout.results)
                               if f.name.startswith(prefix) and (resolved or not f.name.startswith(reviewed))]),
            "rejected": count([f for f in files(self.layout.rejected(r))
                               if resolved or not f.name.startswith(self.layout.REVIEWED_REJECTED_PREFIX)]),
            "awaiting": 0 if resolved else count(files(self.layout.review_queue(r))),
            "infer_quarantined": infer.records_quarantined if infer else 0,
            "judge_quarantined": judge.records_quarantined if judge else 0,
        }

    # -- step: decide ---------------------------------------------------------------

    def decide(self, r: int) -> Decision:
        """What follows round ``r``: next_round, tail (hybrid), done, or exhausted. Sync and cheap."""
        name = self.layout.step_name(r, "decision")
        if (data := self.ledger.read(name)) is not None:
            return Decision.from_dict(data)
        if self.spec.strategy == "in_place":
            raise StepOrderError("strategy 'in_place' has no rounds to decide: run tail(0)")
        infer = PhaseSummary.from_dict(self._require(self.layout.step_name(r, "infer"), f"run infer({r}) first"))
        judge = PhaseSummary.from_dict(self._require(self.layout.step_name(r, "judge"), f"run judge({r}) first"))
        last = self.ledger.read(self.layout.step_name(r, "recompact")) if r > 0 and self.spec.strategy == "hybrid" else None
        recompact_s = float(last["wall_s"]) if last else 0.0
        reviewed = None
        if judge.counts.get(REVIEW_OUTPUT, 0):
            reviewed = self.ledger.read(review.ledger_resolved(r))
            if reviewed is None:
                raise review.ReviewPending(f"run {self.spec.run!r} round {r}: {judge.counts[REVIEW_OUTPUT]} record(s) sent to "
                                           f"review; run resolve_review({r}) once the queue is empty")
        decision = decide_round(self.spec, r, infer, judge, recompact_s=recompact_s, reviewed=reviewed)
        decision = replace(decision, figures={**decision.figures, **self._eta(r, infer, judge, decision.kind, recompact_s)})
        self.ledger.write(name, decision.as_dict())
        return decision

    def _eta(self, r: int, infer: PhaseSummary, judge: PhaseSummary, kind: str, recompact_s: float) -> dict[str, Any]:
        """The run's ETA from this round's measured throughput (when the run has an ``eta``), and
        the plan's figure when one was recorded."""
        out: dict[str, Any] = {}
        if self.eta is not None:
            try:
                out["eta_run_s"] = round(self.eta(self.spec, r, infer, judge, kind, recompact_s=recompact_s), 1)
            except Exception as exc:  # an estimate must never stop a run
                log.warning("run %s: no ETA after round %d: %s", self.spec.run, r, exc)
        if (plan := self.ledger.read(RunLayout.PLAN)) is not None:
            out["planned_run_wall_s"] = next((s["wall_s"] for s in plan.get("strategies", []) if s["strategy"] == self.spec.strategy), None)
        return out

    # -- step: recompact ------------------------------------------------------------

    async def recompact(self, r: int) -> RecompactSummary:
        """rejected(r) -> pending(r + 1) in full shards."""
        name = self.layout.step_name(r + 1, "recompact")
        if (data := await asyncio.to_thread(self.resume.done_with_output, name, self.layout.pending(r + 1))) is not None:
            return RecompactSummary.from_dict({**data, "resumed": True})
        await asyncio.to_thread(self._require, self.layout.step_name(r, "judge"), f"run judge({r}) first")
        t0 = time.perf_counter()
        families = await asyncio.to_thread(self._family_cuts)
        records, shards_in, shards_out, cuts_shared = await asyncio.to_thread(
            passes.recompact, self.layout.rejected(r), self.layout.pending(r + 1),
            records_per_shard=self.spec.shard_records, storage_options=self.storage_options,
            failed_dst=self.layout.failed_records(r), round=r, families=families,
        )
        summary = RecompactSummary(round=r + 1, input_url=self.layout.rejected(r), output_url=self.layout.pending(r + 1),
                                   records=records, shards_in=shards_in, shards_out=shards_out, wall_s=time.perf_counter() - t0,
                                   families=families is not None, cuts_shared=cuts_shared)
        await asyncio.to_thread(self.ledger.write, name, summary.as_dict())
        return summary

    # -- step: tail -----------------------------------------------------------------

    async def tail(self, from_round: int) -> PhaseSummary:
        """Strategy 2 over pending(from_round): each record retried in place to approval or max_attempts.

        Records in pending(r) have had ``r`` attempts, so each task gets the attempts left
        (``max_attempts - r``); its rows are split into results (approved) and
        tail/unfinished (max_attempts, error).
        """
        if (done := await asyncio.to_thread(self._phase_done, RunLayout.TAIL)) is not None:
            return done
        # without a judge a record is inferred once: nothing is rejected, a failure is final
        attempts_left = self.spec.max_attempts - from_round if self.spec.judged else 1
        if attempts_left < 1:
            raise StepOrderError(f"tail({from_round}): no attempts left (max_attempts {self.spec.max_attempts})")
        items, records = await asyncio.to_thread(self._pending_items, from_round)
        instance = await asyncio.to_thread(self._instance)
        families = await asyncio.to_thread(self._families, items)

        def make(index: int, shard: JsonlFile) -> TaskSpec:
            outputs = {"output": join(self.layout.tail_output, part(index)), "checkpoint": self.layout.tail_checkpoint(index)}
            if self.spec.judge_pool is not None:  # the judge's own model: each wave is judged on its pool
                outputs[JUDGE_POOL_OUTPUT] = self.layout.tail_judge_waves(index)
            return TaskSpec(
                task_id=self.layout.task_id(from_round, "retry", index, instance=instance), kind="retry", input_url=shard.url,
                affinity=families.get(index),
                outputs=outputs, infer=self.spec.request_infer, judge=self.spec.judge.task_config(), max_attempts=attempts_left,
                chunk_size=self.spec.chunk_size,
                round=from_round, storage_options_ref=self.spec.pool.storage_options_ref, order=self._order,
                result_cache=self.spec.result_cache_url, dedup_scope=self._dedup_scope(from_round, "retry", instance),
                progress_url=self.layout.live_progress_file(RunLayout.TAIL, index),
            )

        def split(index: int, result: TaskResult) -> dict[str, Any]:
            return passes.split_tail_shard(
                join(self.layout.tail_output, part(index)), self.layout.tail_approved_shard(index),
                join(self.layout.tail_unfinished, part(index)), storage_options=self.storage_options,
            )

        summary = await self._fan_out(Phase(
            round=from_round, kind="tail", step=RunLayout.TAIL, items=items, records=records, make_task=make,
            quarantine_url=self.layout.tail_failed_entry, after=split,
            input_url=self.layout.pending(from_round), output_url=self.layout.tail_output,
        ))
        await asyncio.to_thread(self.ledger.write, RunLayout.TAIL, {**summary.as_dict(), "from_round": from_round})
        return summary

    # -- whole steps for the Dagster assets (each asset calls one) ---------------------

    async def judged_round(self, r: int) -> JudgedRound:
        """Judge round ``r``, decide what follows it, and return everything about the round.

        A round that sent records to people is not decided yet: its ``review`` says where
        the queue stands (``resolve_review`` then ``decide`` follow once it is done).
        """
        await self.judge(r)
        status = None
        if await asyncio.to_thread(self.needs_review, r):
            status = await asyncio.to_thread(self.review_status, r)
        else:
            await asyncio.to_thread(self.decide, r)
        return await asyncio.to_thread(self._judged_round, r, status)

    def _judged_round(self, r: int, status: review.ReviewStatus | None = None) -> JudgedRound:
        view = self.ledger.view()
        prefix = self.layout.approved_prefix(r)
        results = self._dir(self.layout.results)
        shards = [f.url for f in results.shards() if f.name.startswith(prefix)] if results.exists_sync() else []
        return JudgedRound(round=view.rounds[r], approved_shards=shards, view=view, review=status)

    async def sharded_input(self) -> StepOutcome:
        """``shard``, with the shards it committed (what the ``sharded`` asset shows)."""
        summary = await self.shard()
        return await asyncio.to_thread(self._outcome, summary, summary.output_url)

    async def pending_round(self, r: int) -> StepOutcome:
        """Round ``r``'s input with its shards: round ``r - 1``'s rejected records repacked
        (a ``RecompactSummary``), or for round 0 the sharded input itself (its ``ShardSummary``)."""
        summary = await self.recompact(r - 1) if r > 0 else None
        return await asyncio.to_thread(self._outcome, summary, self.layout.pending(r))

    async def inferred_round(self, r: int) -> StepOutcome:
        """``infer``, with the output shards it wrote (what the ``inferred`` asset shows)."""
        summary = await self.infer(r)
        return await asyncio.to_thread(self._outcome, summary, summary.output_url)

    def _outcome(self, summary: Any, shards_url: str) -> StepOutcome:
        view = self.ledger.view()
        return StepOutcome(summary if summary is not None else view.shard, view, [f.url for f in self._dir(shards_url).shards()])

    async def tail_from(self, from_round: int) -> StepOutcome:
        """The tail as the sensor hands it over: repack round ``from_round - 1``'s rejected
        records first (``from_round`` 0: the sharded input), then retry them in place."""
        if from_round > 0:
            await self.recompact(from_round - 1)
        summary = await self.tail(from_round)
        return StepOutcome(summary, await asyncio.to_thread(self.ledger.view))

    async def finish(self) -> StepOutcome:
        """``finalize``, with the ledger and the result shards it proved."""
        summary = await self.finalize()

        def listing() -> StepOutcome:
            results = self._dir(self.layout.results)
            return StepOutcome(summary, self.ledger.view(), [f.url for f in results.shards()] if results.exists_sync() else [])

        return await asyncio.to_thread(listing)

    # -- step: finalize -------------------------------------------------------------

    async def finalize(self) -> RunSummary:
        """Write exhausted rows if the rounds hit their cap, check conservation, record the run."""
        return await asyncio.to_thread(self._finalize)

    def _recorded(self) -> tuple[int, list[PhaseSummary], list[Decision], PhaseSummary | None]:
        """What the ledger holds: rounds inferred, their phases (+ the tail's), decisions, the tail."""
        phases: list[PhaseSummary] = []
        decisions: list[Decision] = []
        r = 0
        while (infer := self._phase_done(self.layout.step_name(r, "infer"))) is not None:
            phases.append(infer)
            if (judge := self._phase_done(self.layout.step_name(r, "judge"))) is not None:
                phases.append(judge)
            if (d := self.ledger.read_as(self.layout.step_name(r, "decision"), Decision)) is not None:
                decisions.append(d)
            r += 1
        tail = self._phase_done(RunLayout.TAIL)
        if tail:
            phases.append(tail)
        return r, phases, decisions, tail

    def quarantined(self) -> list[QuarantineEntry]:
        """Every quarantined shard entry of the run."""
        return [q for p in self._recorded()[1] for q in p.quarantined]

    def terminal_sources(self) -> list[IdSource]:
        """The id sets conservation is checked over: the input and every terminal state.

        ``finalize`` checks these; Dagster's whole-run checks re-check the same list
        over the run's storage (blocking I/O: call it off the event loop).
        """
        r, phases, _, _ = self._recorded()
        sources = [
            IdSource("input", (self.layout.sharded,)),
            IdSource("approved", (self.layout.results,)),
            IdSource("exhausted", (self.layout.exhausted,)),
            IdSource("unfinished", (self.layout.tail_unfinished,), status_field=True),
            IdSource("failed", tuple(self.layout.failed_records(i) for i in range(r))),
        ]
        awaiting = tuple(self.layout.review_queue(i) for i in range(r)
                         if self.needs_review(i) and self.ledger.read(review.ledger_resolved(i)) is None)
        if awaiting:  # a terminal-state-to-be: conservation holds while people review
            sources.append(IdSource(review.AWAITING_REVIEW, awaiting))
        quarantined = [q for p in phases for q in p.quarantined]
        if quarantined:
            sources.append(IdSource("failed", tuple(q.shard for q in quarantined), is_dir=False))
        return sources

    def _trim_result_cache(self) -> dict[str, Any]:
        """Bound the cross-run result cache (``cache.max_bytes``, oldest entries first); what it
        holds after. A failed trim costs the bound for now, never the run (the next run trims)."""
        url = self.spec.result_cache_url
        if url is None:
            return {}
        try:
            report = ResultCache(url, self.storage_options).trim(self.spec.cache.max_bytes)
        except Exception as exc:
            log.warning("run %s: trimming the result cache %s failed: %s", self.spec.run, url, exc)
            return {"url": url, "error": str(exc)}
        return {"url": url, "max_bytes": self.spec.cache.max_bytes, **report.as_dict()}

    def _finalize(self) -> RunSummary:
        t0 = time.perf_counter()
        shard = ShardSummary.from_dict(self._require(RunLayout.SHARD, "run shard() first"))
        _, phases, decisions, tail = self._recorded()
        last = decisions[-1] if decisions else None
        if self.spec.strategy == "in_place" or (last and last.kind == "tail"):
            if tail is None:
                raise StepOrderError(f"run {self.spec.run!r}: the tail has not run yet: run tail() first")
        elif last is None or last.kind not in ("done", "exhausted"):
            raise StepOrderError(f"run {self.spec.run!r}: the rounds have not finished (last decision: {last and last.kind})")
        exhausted = 0
        # the last round's rejected rows: those left at the cap, and any permanent failures of
        # a round that had nothing else left to retry
        if last is not None and not tail and (last.kind == "exhausted" or (last.kind == "done" and last.figures.get("failed"))):
            exhausted = passes.write_exhausted(
                [self.layout.rejected(last.round)], self.layout.exhausted, round=last.round, storage_options=self.storage_options,
                failed_dst=self.layout.failed_records(last.round), every_error=not self.spec.judged,
            )
        report = check_conservation(self.terminal_sources(), input_records=shard.records, storage_options=self.storage_options)
        t = report.terminal
        quarantined = sum(p.records_quarantined for p in phases)
        status = ("quarantined" if quarantined else "exhausted" if t["exhausted"] or t["max_attempts"]
                  else "records_failed" if t["failed"] else "converged")
        summary = RunSummary(
            run=self.spec.run, url=self.layout.root, strategy=self.spec.strategy, status=status,  # type: ignore[arg-type]
            records=shard.records, approved=t["approved"], exhausted=t["exhausted"], max_attempts=t["max_attempts"],
            failed=t["failed"], quarantined=quarantined, rounds=len([p for p in phases if p.phase == "infer"]), tail=tail is not None,
            results_url=self.layout.results, conservation=report,
            tokens_in=sum(p.tokens_in for p in phases), tokens_out=sum(p.tokens_out for p in phases),
            engine_busy_s=sum(p.engine_busy_s for p in phases),
            wall_s=sum(p.wall_s for p in phases) + shard.wall_s + (time.perf_counter() - t0),
            result_cache_lookups=sum(p.result_cache_lookups for p in phases),
            result_cache_hits=sum(p.result_cache_hits for p in phases),
            engine_requests=sum(p.engine_requests for p in phases),
            result_cache=self._trim_result_cache(),
        )
        self.ledger.write(RunLayout.RUN, summary.as_dict())
        if not report.ok:
            raise ConservationError(
                f"run {self.spec.run!r}: conservation failed: {report.missing} missing, {report.extra} extra, "
                f"{report.duplicate_results} duplicated in results (input {report.input} of {shard.records}); "
                f"e.g. {report.examples[:5]}"
                + (f"; unreadable (damaged in storage): {report.unreadable}" if report.unreadable else ""), report.as_dict(),
            )
        if exhausted:
            log.warning("run %s: %d record(s) exhausted max_rounds: see %s", self.spec.run, exhausted, self.layout.exhausted)
        return summary
