"""A round's phases: infer (pending(r) -> inferred(r)), round 0 streamed beside the layout
pass, and judge (inferred(r) -> results + rejected(r), the review queue opened at the gate).

Each phase describes its fan-out of shard tasks as a ``fanout.Phase``; ``FanOut`` skips the
shards whose progress record says they are done, so a phase called again resumes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from batch_inference.pipeline import affinity
from batch_inference.pipeline.fanout import Item, Phase
from batch_inference.pipeline.gate import RoundGate
from batch_inference.pipeline.layout import part
from batch_inference.pipeline.ledger import ConservationError
from batch_inference.pipeline.steps.context import RunContext, StepOrderError
from batch_inference.pipeline.steps.tasks import task_spec
from batch_inference.pipeline.stream import ShardFeed
from batch_inference.pipeline.summaries import PhaseSummary
from batch_inference.pool.protocol import REVIEW_OUTPUT, TaskRunner, TaskSpec
from batch_inference.storage import JsonlFile
from batch_inference.storage.urls import join

log = logging.getLogger(__name__)


class InferStep:
    """infer(r): one output shard per pending shard. Round 0 takes the shard step's feed
    (``take_feed``) once: a retry finds it taken and reads ``sharded/`` whole."""

    def __init__(self, ctx: RunContext, take_feed: Callable[[], ShardFeed | None]) -> None:
        self.ctx = ctx
        self.take_feed = take_feed

    async def run(self, r: int, runner: TaskRunner | None) -> PhaseSummary:
        ctx = self.ctx
        name = ctx.layout.step_name(r, "infer")
        if (done := await asyncio.to_thread(self.recorded, r, name)) is not None:
            return done
        if r == 0 and (feed := self.take_feed()) is not None:
            await feed.first()
            if feed.streaming and (streamed := await self._streamed(name, feed, runner)) is not None:
                return streamed
            if feed.error is not None:
                raise feed.error
        items, records = await asyncio.to_thread(ctx.pending_items, r)
        instance = await asyncio.to_thread(ctx.instance)
        families = await asyncio.to_thread(ctx.families, items)
        summary = await ctx.fanout(self.phase(r, name, items, records, instance, families), runner).run()
        await asyncio.to_thread(ctx.ledger.write, name, summary.as_dict())
        return summary

    def phase(self, r: int, name: str, items: list[Item], records: dict[int, int], instance: str,
              families: dict[int, str]) -> Phase:
        layout = self.ctx.layout

        def make(index: int, shard: JsonlFile) -> TaskSpec:
            return task_spec(self.ctx, r, "infer", index, shard.url, {"output": join(layout.inferred(r), part(index))},
                             step=name, instance=instance, families=families)

        return Phase(
            round=r, kind="infer", step=name, items=items, records=records, make_task=make,
            quarantine_url=lambda i: layout.failed_entry(r, "infer", i),
            input_url=layout.pending(r), output_url=layout.inferred(r),
        )

    def recorded(self, r: int, name: str) -> PhaseSummary | None:
        """infer(r)'s ledger entry, if it covers every shard of pending(r) (blocking).

        An entry short of shards with some never run (what a retry of streamed round 0 once
        recorded, reading the feed its first attempt had drained) is not trusted: while the
        round is not judged yet, None, so the phase runs the shards left out (those finished
        are skipped); once judged, the round's later steps stand without them, and this fails
        naming them."""
        ctx, layout = self.ctx, self.ctx.layout
        done = ctx.phase_done(name)
        if done is None:
            return None
        pending = ctx.dir(layout.pending(r))
        man = pending.manifest()
        if man is None or done.shards == len(man.shards):
            return done
        shards = pending.shards()
        ran = ctx.ledger.progress(name, list(range(len(shards))))
        never_ran = [f for i, f in enumerate(shards)
                     if i not in ran and not ctx.file(layout.failed_entry(r, "infer", i)).exists_sync()]
        if not never_ran:
            return done
        per_shard = {s["name"]: int(s["records"]) for s in man.shards}
        lost = sum(per_shard.get(f.name, 0) for f in never_ran)
        named = ", ".join(f.url for f in never_ran[:10]) + (" ..." if len(never_ran) > 10 else "")
        told = (f"run {ctx.spec.run!r}: {layout.ledger_file(name)} records {done.shards} of the {len(shards)} shards of "
                f"{pending.url}; {len(never_ran)} never ran: {named}")
        if ctx.ledger.read(layout.step_name(r, "judge")) is None:
            log.warning("%s; running them now", told)
            return None
        raise ConservationError(
            f"{told}, and round {r} was judged without them, so their {lost} records have no terminal state. "
            f"Give the spec a new `run` name, or delete {layout.root} to start over.",
            {"never_ran": [f.url for f in never_ran], "records": lost})

    async def _streamed(self, name: str, feed: ShardFeed, runner: TaskRunner | None) -> PhaseSummary | None:
        """Round 0's infer phase on each shard as the layout pass commits it (``pipeline.stream``):
        the same tasks as after the pass, dispatched while its merge and rewrite go on. Its
        ledger entry is written once the shard step has finished and committed exactly the
        shards it streamed, and every one of them ran (else None, with nothing recorded: the
        caller runs the rest from ``sharded/``); a shard step that fails ends the dispatch, and
        its error is raised once what was sent has finished."""
        ctx = self.ctx
        items: list[Item] = []
        records: dict[int, int] = {}
        families: dict[int, str] = {}
        signer = ctx.signer() if ctx.routes_by_family() else None
        sharded = ctx.layout.sharded
        fanout = ctx.fanout(self.phase(0, name, items, records, feed.instance, families), runner)

        async def ready() -> AsyncIterator[Item]:
            wave = max(1, fanout.runner.limit)  # the first wave whole, then each shard as it comes
            while batch := await feed.take(wave):
                wave = 1
                fresh = [(fed.index, ctx.file(join(sharded, fed.name))) for fed in batch]
                if signer is not None:  # the blocks every record so far shares stand for the final count
                    families.update(await asyncio.to_thread(
                        affinity.shard_families, fresh, ctx.spec.request_infer, signer, common=batch[-1].common))
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
                        ctx.spec.run, len(ran), len(feed.fed), ", ".join(left[:10]), sharded)
            return None
        await asyncio.to_thread(ctx.ledger.write, name, summary.as_dict())
        return summary

    def _check_streamed(self, feed: ShardFeed) -> None:
        """The shards round 0 ran on are the ones the shard step committed (blocking)."""
        sharded = self.ctx.layout.sharded
        man = self.ctx.dir(sharded).manifest()
        committed = [(s["name"], int(s["records"])) for s in man.shards] if man is not None else None
        if committed != [(f.name, f.records) for f in feed.fed]:
            raise StepOrderError(f"run {self.ctx.spec.run!r}: round 0 ran on {len(feed.fed)} shards of {sharded} as the "
                                 f"layout pass wrote them, but the shard step committed {committed and len(committed)}")


class JudgeStep:
    """judge(r): inferred(r) -> results (approved) + rejected(r) (+ the review queue, opened at
    ``gate``); checks approved + rejected (+ awaiting review) == inferred for every shard."""

    def __init__(self, ctx: RunContext, gate: Callable[[], RoundGate]) -> None:
        self.ctx = ctx
        self.gate = gate

    async def run(self, r: int, runner: TaskRunner | None) -> PhaseSummary:
        ctx, layout, spec = self.ctx, self.ctx.layout, self.ctx.spec
        name = layout.step_name(r, "judge")
        if (done := await asyncio.to_thread(ctx.phase_done, name)) is not None:
            return done
        infer_step = layout.step_name(r, "infer")
        await asyncio.to_thread(ctx.require, infer_step, f"run infer({r}) first")
        indices = await asyncio.to_thread(self._all_indices, r)
        inferred = await asyncio.to_thread(ctx.ledger.progress, infer_step, indices)
        items = [(i, ctx.file(join(layout.inferred(r), part(i)))) for i in sorted(inferred)]
        written = {i: int(rec["records_in"]) for i, rec in inferred.items()}
        instance = await asyncio.to_thread(ctx.instance)
        families = await asyncio.to_thread(ctx.families, items)

        def make(index: int, shard: JsonlFile) -> TaskSpec:
            outputs = {"approved": layout.approved_shard(r, index), "rejected": join(layout.rejected(r), part(index))}
            if spec.judge.reviews:
                outputs[REVIEW_OUTPUT] = join(layout.review_queue(r), part(index))
            return task_spec(ctx, r, "judge", index, shard.url, outputs, step=name, instance=instance, families=families,
                             judge=spec.judge.task_config())

        fan = ctx.fanout(Phase(
            round=r, kind="judge", step=name, items=items, records=written, make_task=make,
            quarantine_url=lambda i: layout.failed_entry(r, "judge", i),
            input_url=layout.inferred(r), output_url=layout.rejected(r),
        ), runner)
        summary = await fan.run()
        self._check_round(r, written, fan.done)  # the progress records the fan-out holds: no second read
        if summary.counts.get(REVIEW_OUTPUT, 0):
            records = summary.counts[REVIEW_OUTPUT]
            await asyncio.to_thread(lambda: self.gate().open(spec, layout, ctx.ledger, r, records))  # a first gate loads off the loop
        await asyncio.to_thread(ctx.ledger.write, name, summary.as_dict())
        return summary

    def _all_indices(self, r: int) -> list[int]:
        man = self.ctx.dir(self.ctx.layout.pending(r)).manifest()
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
                bad.append(f"{join(self.ctx.layout.inferred(r), part(i))} (inferred {inferred[i]}, approved "
                           f"{c.get('approved', 0)}, rejected {c.get('rejected', 0)}{waiting})")
        if bad:
            terms = "approved + rejected + awaiting review" if self.ctx.spec.judge.reviews else "approved + rejected"
            raise ConservationError(f"run {self.ctx.spec.run!r} round {r}: {terms} != inferred for shard(s): "
                                    + "; ".join(bad), {"shards": bad})
