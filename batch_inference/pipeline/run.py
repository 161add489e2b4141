"""A pipeline run as idempotent, resumable steps (docs/ARCHITECTURE.md "pipeline").

``PipelineRun`` holds no state between steps beyond what is in storage: every step reads
its inputs and the ledger, skips the shards whose progress record says they are done,
dispatches the rest through the ``TaskRunner`` with ``dispatch_bounded`` (at most
``runner.limit`` tasks in flight), and records its summary. So the Dagster layer can
call each step from its own process, and a killed driver re-runs into a resume.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from batch_inference.pipeline import inputs, passes
from batch_inference.pipeline.crossover import choose_crossover
from batch_inference.pipeline.layout import RunLayout, part
from batch_inference.pipeline.ledger import ConservationError, IdSource, Ledger, check_conservation
from batch_inference.pipeline.spec import PipelineSpec
from batch_inference.pipeline.summaries import Decision, PhaseSummary, RecompactSummary, RunSummary, ShardSummary
from batch_inference.pipeline.transient import is_transient
from batch_inference.pool import dispatch_bounded
from batch_inference.pool.protocol import TaskFailed, TaskResult, TaskRunner, TaskSpec
from batch_inference.storage import JsonlDir, JsonlFile
from batch_inference.storage.urls import join

log = logging.getLogger(__name__)


class Reporter(Protocol):
    """Progress callbacks (the CLI draws bars from them); all optional no-ops by default."""

    def phase_started(self, name: str, total_records: int) -> None: ...

    def shard_done(self, name: str, records: int, counts: dict[str, int]) -> None: ...

    def phase_ended(self, name: str) -> None: ...


class _NullReporter:
    def phase_started(self, name: str, total_records: int) -> None:
        pass

    def shard_done(self, name: str, records: int, counts: dict[str, int]) -> None:
        pass

    def phase_ended(self, name: str) -> None:
        pass


class StepOrderError(RuntimeError):
    """A step was called before the step that produces its input."""


Item = tuple[int, JsonlFile]


class PipelineRun:
    """The steps of one run. ``runner`` is needed only by ``infer``, ``judge`` and ``tail``."""

    def __init__(self, spec: PipelineSpec, runner: TaskRunner | None = None, *, reporter: Reporter | None = None) -> None:
        self.spec = spec
        self.runner = runner
        self.reporter: Reporter = reporter or _NullReporter()
        self.layout = RunLayout(spec.output, spec.run)
        self.storage_options = spec.storage_options or None
        self.ledger = Ledger(self.layout, spec.storage_options)

    # -- helpers --------------------------------------------------------------------

    def _dir(self, url: str) -> JsonlDir:
        return JsonlDir(url, storage_options=self.storage_options)

    def _file(self, url: str) -> JsonlFile:
        return JsonlFile(url, storage_options=self.storage_options)

    def _task_id(self, r: int, phase: str, index: int) -> str:
        return f"{self.spec.run}/r{r:02d}/{phase}/{index:05d}"

    def _require(self, name: str, hint: str) -> dict[str, Any]:
        data = self.ledger.read(name)
        if data is None:
            raise StepOrderError(f"run {self.spec.run!r}: ledger/{name}.json is missing: {hint}")
        return data

    def _pending_items(self, r: int) -> tuple[list[Item], dict[str, int]]:
        """Round ``r``'s pending shards by index, and their record counts from the manifest."""
        d = self._dir(self.layout.pending(r))
        man = d.manifest()
        if man is None:
            step = "shard()" if r == 0 else f"recompact({r - 1})"
            raise StepOrderError(f"run {self.spec.run!r}: {d.url} is not committed yet: run {step} first")
        sizes = {s["name"]: int(s["records"]) for s in man.shards}
        return list(enumerate(d.shards())), sizes

    # -- step: shard ----------------------------------------------------------------

    async def shard(self) -> ShardSummary:
        """Reshard the input once (CPU): ids assigned where missing, duplicate ids reported."""
        if (done := await asyncio.to_thread(self._done_with_output, "shard", self.layout.sharded)) is not None:
            return ShardSummary.from_dict({**done, "resumed": True})
        await asyncio.to_thread(self.ledger.write, "spec", self.spec.public_dict())
        t0 = time.perf_counter()
        fmt, detected = await asyncio.to_thread(inputs.resolve_format, self.spec)
        if detected:
            log.info("run %s: %s is OpenAI Batch input (detected: input_format auto); converting at sharding", self.spec.run, self.spec.input)
        reader = inputs.openai_reader(self.spec) if fmt == "openai_batch" else None
        report = await asyncio.to_thread(
            passes.shard_input, self.spec.input, self.layout.sharded,
            records_per_shard=self.spec.shard_records, storage_options=self.storage_options,
            quarantine_url=self.layout.input_quarantine, transform=reader.convert if reader else None,
        )
        if reader is not None:  # refused before any GPU time: the shard step is not recorded
            inputs.check_openai_input(reader, report, self.spec.input)
        if report.malformed:
            log.warning("run %s: %d malformed input line(s) quarantined: see %s", self.spec.run, report.malformed, self.layout.input_quarantine)
        dups = report.duplicate_ids
        if dups:
            log.warning("run %s: %d duplicate input id(s), kept (not merged), e.g. %s", self.spec.run, len(dups), list(dups)[:5])
        summary = ShardSummary(
            input_url=self.spec.input, output_url=self.layout.sharded, records=report.records, shards=report.shards,
            ids_assigned=report.ids_assigned, duplicate_ids=len(dups), duplicate_examples=list(dups)[:10],
            wall_s=time.perf_counter() - t0, malformed=report.malformed, input_format=fmt,
        )
        await asyncio.to_thread(self.ledger.write, "shard", summary.as_dict())
        return summary

    # -- fan-out --------------------------------------------------------------------

    async def _fan_out(
        self,
        *,
        r: int,
        phase: str,
        step: str,
        items: list[Item],
        sizes: Callable[[Item], Awaitable[int]],
        make_task: Callable[[int, JsonlFile], TaskSpec],
        failed_entry: Callable[[int], str],
        after: Callable[[int, TaskResult], Awaitable[dict[str, Any]]] | None = None,
        input_url: str,
        output_url: str,
        total_records: int,
    ) -> PhaseSummary:
        """Dispatch one task per item not yet done; quarantine tasks that exhaust retries."""
        if self.runner is None:
            raise StepOrderError(f"{step} needs a TaskRunner: PipelineRun(spec, runner)")
        runner = self.runner
        done: dict[int, dict[str, Any]] = await asyncio.to_thread(self._progress, step, [i for i, _ in items])
        quarantined: list[dict[str, Any]] = []
        todo = [it for it in items if it[0] not in done]
        name = f"round {r} {phase}" if phase != "tail" else "tail"
        self.reporter.phase_started(name, total_records)
        for rec in done.values():
            self.reporter.shard_done(name, int(rec["records_in"]), rec["counts"])
        retried_before = int(getattr(runner, "retried", 0))
        t0 = time.perf_counter()
        last_start = t0

        async def run_one(item: Item) -> dict[str, Any]:
            nonlocal last_start
            index, shard = item
            spec = make_task(index, shard)
            last_start = time.perf_counter()
            result = await runner.run_task(spec)
            rec = {**result.model_dump(mode="json"), "index": index, "input": shard.url}
            if after is not None:
                rec["after"] = await after(index, result)
            await asyncio.to_thread(self._clear_stale_quarantine, failed_entry(index))
            await asyncio.to_thread(self.ledger.write_progress, step, index, rec)
            return rec

        def on_result(rec: dict[str, Any]) -> None:
            done[int(rec["index"])] = rec
            self.reporter.shard_done(name, int(rec["records_in"]), rec["counts"])

        async def on_error(item: Item, exc: BaseException) -> None:
            if not isinstance(exc, TaskFailed):
                # Cancellation, Ctrl-C, or the driver's own storage failing (e.g. writing the
                # progress record of a task that succeeded): not the shard's fault, never
                # quarantined; the run stops and a re-run resumes.
                raise exc
            index, shard = item
            await asyncio.to_thread(self._discard_outputs, make_task(index, shard))
            entry = {"shard": shard.url, "phase": phase, "error": str(exc), "records": await sizes(item),
                     "task_id": exc.spec.task_id, "round": r}
            # Never requeued: a deterministic failure would loop until max_rounds.
            log.error("run %s: quarantined %s shard %s: %s", self.spec.run, phase, shard.url, exc)
            async with self._file(failed_entry(index)).writer() as w:
                await w.write(entry)
            quarantined.append(entry)
            self.reporter.shard_done(name, entry["records"], {})

        await dispatch_bounded(todo, run_one, on_result, on_error, limit=max(1, runner.limit))
        wall = time.perf_counter() - t0
        self.reporter.phase_ended(name)
        recs = [done[i] for i in sorted(done)]
        counts: dict[str, int] = {}
        for rec in recs:
            for k, v in rec["counts"].items():
                counts[k] = counts.get(k, 0) + int(v)
        n_req = sum(int(x["records_in"]) for x in recs) or 1
        return PhaseSummary(
            round=r, phase=phase, input_url=input_url, output_url=output_url,  # type: ignore[arg-type]
            shards=len(items), shards_run=len(todo), records_in=sum(int(x["records_in"]) for x in recs),
            counts=counts, tokens_in=sum(int(x["tokens_in"]) for x in recs), tokens_out=sum(int(x["tokens_out"]) for x in recs),
            engine_busy_s=sum(float(x["engine_busy_s"]) for x in recs), wall_s=wall,
            drain_s=(wall - (last_start - t0)) if todo else 0.0,
            longest_task_s=max((float(done[i]["wall_s"]) for i, _ in todo if i in done), default=0.0),
            avg_fill=sum(float(x["avg_fill"]) * int(x["records_in"]) for x in recs) / n_req,
            cached_tasks=sum(1 for x in recs if x.get("cached")),
            task_retries=int(getattr(runner, "retried", 0)) - retried_before,
            workers=len({str(x["worker"]) for x in recs}),
            quarantined=sorted(quarantined, key=lambda q: q["shard"]),
        )

    def _clear_stale_quarantine(self, url: str) -> None:
        """A shard quarantined by an interrupted earlier call that has now succeeded."""
        if (f := self._file(url)).exists_sync():
            f.fs.rm(f.path)

    def _discard_outputs(self, spec: TaskSpec) -> None:
        """A quarantined task's records are all ``failed``: no partial output may count too."""
        for key, url in spec.outputs.items():
            if key != "checkpoint" and (f := self._file(url)).exists_sync():
                f.fs.rm(f.path)

    def _progress(self, step: str, indices: list[int]) -> dict[int, dict[str, Any]]:
        """Progress records of this step's finished shards (listing once, then reading those)."""
        fs, path = self.ledger.fs, self.ledger._path(self.layout.progress_file(step, 0)).rsplit("/", 1)[0]
        try:
            fs.invalidate_cache(path)
            names = {n.rsplit("/", 1)[-1] for n in fs.ls(path, detail=False)}
        except FileNotFoundError:
            return {}
        out: dict[int, dict[str, Any]] = {}
        for i in indices:
            if f"part-{i:05d}.json" in names:
                rec = self.ledger.read_progress(step, i)
                if rec is not None:
                    out[i] = rec
        return out

    def _done_with_output(self, name: str, output_url: str) -> dict[str, Any] | None:
        """The step's ledger entry if it finished and its output directory is committed."""
        data = self.ledger.read(name)
        return data if data is not None and self._dir(output_url).manifest() is not None else None

    def _phase_done(self, name: str) -> PhaseSummary | None:
        data = self.ledger.read(name)
        return PhaseSummary.from_dict(data) if data is not None else None

    # -- step: infer ----------------------------------------------------------------

    async def infer(self, r: int) -> PhaseSummary:
        """pending(r) -> inferred(r), one output shard per pending shard."""
        name = f"round-{r:02d}-infer"
        if (done := await asyncio.to_thread(self._phase_done, name)) is not None:
            return done
        items, sizes = await asyncio.to_thread(self._pending_items, r)

        async def size(item: Item) -> int:
            return sizes.get(item[1].name, 0)

        def make(index: int, shard: JsonlFile) -> TaskSpec:
            return TaskSpec(
                task_id=self._task_id(r, "infer", index), kind="infer", input_url=shard.url,
                outputs={"output": join(self.layout.inferred(r), part(index))}, infer=self.spec.infer,
                chunk_size=self.spec.chunk_size, round=r, storage_options_ref=self.spec.pool.storage_options_ref,
            )

        summary = await self._fan_out(
            r=r, phase="infer", step=name, items=items, sizes=size, make_task=make,
            failed_entry=lambda i: self.layout.failed_entry(r, "infer", i),
            input_url=self.layout.pending(r), output_url=self.layout.inferred(r), total_records=sum(sizes.values()),
        )
        await asyncio.to_thread(self.ledger.write, name, summary.as_dict())
        return summary

    # -- step: judge ----------------------------------------------------------------

    async def judge(self, r: int) -> PhaseSummary:
        """inferred(r) -> results (approved) + rejected(r); checks approved + rejected == inferred."""
        name = f"round-{r:02d}-judge"
        if (done := await asyncio.to_thread(self._phase_done, name)) is not None:
            return done
        await asyncio.to_thread(self._require, f"round-{r:02d}-infer", f"run infer({r}) first")
        indices = await asyncio.to_thread(self._all_indices, r)
        inferred = await asyncio.to_thread(self._progress, f"round-{r:02d}-infer", indices)
        items = [(i, self._file(join(self.layout.inferred(r), part(i)))) for i in sorted(inferred)]
        written = {i: int(rec["records_in"]) for i, rec in inferred.items()}

        async def size(item: Item) -> int:
            return written.get(item[0], 0)

        def make(index: int, shard: JsonlFile) -> TaskSpec:
            return TaskSpec(
                task_id=self._task_id(r, "judge", index), kind="judge", input_url=shard.url,
                outputs={"approved": self.layout.approved_shard(r, index), "rejected": join(self.layout.rejected(r), part(index))},
                judge=self.spec.judge, infer=self.spec.infer, chunk_size=self.spec.chunk_size, round=r,
                storage_options_ref=self.spec.pool.storage_options_ref,
            )

        summary = await self._fan_out(
            r=r, phase="judge", step=name, items=items, sizes=size, make_task=make,
            failed_entry=lambda i: self.layout.failed_entry(r, "judge", i),
            input_url=self.layout.inferred(r), output_url=self.layout.rejected(r), total_records=sum(written.values()),
        )
        await asyncio.to_thread(self._check_round, r, written)
        await asyncio.to_thread(self.ledger.write, name, summary.as_dict())
        return summary

    def _all_indices(self, r: int) -> list[int]:
        man = self._dir(self.layout.pending(r)).manifest()
        return list(range(len(man.shards))) if man else []

    def _check_round(self, r: int, inferred: dict[int, int]) -> None:
        """approved + rejected == inferred for every judged shard, or fail naming the shards."""
        judged = self._progress(f"round-{r:02d}-judge", sorted(inferred))
        bad = []
        for i, rec in judged.items():
            c = rec["counts"]
            if int(c.get("approved", 0)) + int(c.get("rejected", 0)) != inferred[i] or int(rec["records_in"]) != inferred[i]:
                bad.append(f"{join(self.layout.inferred(r), part(i))} (inferred {inferred[i]}, approved {c.get('approved', 0)}, rejected {c.get('rejected', 0)})")
        if bad:
            raise ConservationError(f"run {self.spec.run!r} round {r}: approved + rejected != inferred for shard(s): " + "; ".join(bad), {"shards": bad})

    # -- step: decide ---------------------------------------------------------------

    def decide(self, r: int) -> Decision:
        """What follows round ``r``: next_round, tail (hybrid), done, or exhausted. Sync and cheap."""
        name = f"round-{r:02d}-decision"
        if (data := self.ledger.read(name)) is not None:
            return Decision.from_dict(data)
        if self.spec.strategy == "in_place":
            raise StepOrderError("strategy 'in_place' has no rounds to decide: run tail(0)")
        infer = PhaseSummary.from_dict(self._require(f"round-{r:02d}-infer", f"run infer({r}) first"))
        judge = PhaseSummary.from_dict(self._require(f"round-{r:02d}-judge", f"run judge({r}) first"))
        approved, rejected = judge.counts.get("approved", 0), judge.counts.get("rejected", 0)
        records_in = infer.records_in + infer.records_quarantined
        rounds_left = self.spec.max_rounds - (r + 1)
        attempts_left = self.spec.max_attempts - (r + 1)
        figures: dict[str, Any] = {"records_in": records_in, "approved": approved, "rejected": rejected,
                                   "quarantined": infer.records_quarantined + judge.records_quarantined,
                                   "rounds_left": rounds_left, "attempts_left": attempts_left}
        if rejected == 0:
            kind, reason = "done", "nothing rejected"
        elif attempts_left <= 0:
            kind, reason = "exhausted", f"max_attempts ({self.spec.max_attempts}) reached with {rejected} rejected"
        elif self.spec.strategy == "hybrid":
            last = self.ledger.read(f"round-{r:02d}-recompact") if r > 0 else None
            recompact_s = float(last["wall_s"]) if last else 0.0
            switch, reason, more = choose_crossover(
                self.spec.crossover, round=r, records_in=records_in, approved=approved, rejected=rejected,
                wall_s=infer.wall_s + judge.wall_s,
                engine_s=_per_worker(infer, self.spec.pool.replicas) + _per_worker(judge, self.spec.pool.replicas),
                overhead_s=_gap(infer) + _gap(judge), recompact_s=recompact_s,
                rounds_left=rounds_left, attempts_left=attempts_left,
            )
            figures.update(more)
            if switch or rounds_left <= 0:
                kind = "tail"
                reason = reason if switch else f"max_rounds ({self.spec.max_rounds}) reached: {rejected} to in-place retry"
            else:
                kind = "next_round"
        elif rounds_left <= 0:
            kind, reason = "exhausted", f"max_rounds ({self.spec.max_rounds}) reached with {rejected} still rejected"
        else:
            kind, reason = "next_round", f"{rejected} rejected"
        decision = Decision(round=r, kind=kind, reason=reason, figures=figures)  # type: ignore[arg-type]
        self.ledger.write(name, decision.as_dict())
        return decision

    # -- step: recompact ------------------------------------------------------------

    async def recompact(self, r: int) -> RecompactSummary:
        """rejected(r) -> pending(r + 1) in full shards."""
        name = f"round-{r + 1:02d}-recompact"
        if (data := await asyncio.to_thread(self._done_with_output, name, self.layout.pending(r + 1))) is not None:
            return RecompactSummary.from_dict({**data, "resumed": True})
        await asyncio.to_thread(self._require, f"round-{r:02d}-judge", f"run judge({r}) first")
        t0 = time.perf_counter()
        records, shards_in, shards_out = await asyncio.to_thread(
            passes.recompact, self.layout.rejected(r), self.layout.pending(r + 1),
            records_per_shard=self.spec.shard_records, storage_options=self.storage_options,
            failed_dst=self.layout.failed_records(r), round=r,
        )
        summary = RecompactSummary(round=r + 1, input_url=self.layout.rejected(r), output_url=self.layout.pending(r + 1),
                                   records=records, shards_in=shards_in, shards_out=shards_out, wall_s=time.perf_counter() - t0)
        await asyncio.to_thread(self.ledger.write, name, summary.as_dict())
        return summary

    # -- step: tail -----------------------------------------------------------------

    async def tail(self, from_round: int) -> PhaseSummary:
        """Strategy 2 over pending(from_round): each record retried in place to approval or max_attempts.

        Records in pending(r) have had ``r`` attempts, so each task gets the attempts left
        (``max_attempts - r``); its rows are split into results (approved) and
        tail/unfinished (max_attempts, error).
        """
        if (done := await asyncio.to_thread(self._phase_done, "tail")) is not None:
            return done
        attempts_left = self.spec.max_attempts - from_round
        if attempts_left < 1:
            raise StepOrderError(f"tail({from_round}): no attempts left (max_attempts {self.spec.max_attempts})")
        items, sizes = await asyncio.to_thread(self._pending_items, from_round)

        async def size(item: Item) -> int:
            return sizes.get(item[1].name, 0)

        def make(index: int, shard: JsonlFile) -> TaskSpec:
            return TaskSpec(
                task_id=self._task_id(from_round, "retry", index), kind="retry", input_url=shard.url,
                outputs={"output": join(self.layout.tail_output, part(index)), "checkpoint": self.layout.tail_checkpoint(index)},
                infer=self.spec.infer, judge=self.spec.judge, max_attempts=attempts_left, chunk_size=self.spec.chunk_size,
                round=from_round, storage_options_ref=self.spec.pool.storage_options_ref,
            )

        async def split(index: int, result: TaskResult) -> dict[str, Any]:
            return await asyncio.to_thread(
                passes.split_tail_shard, join(self.layout.tail_output, part(index)), self.layout.tail_approved_shard(index),
                join(self.layout.tail_unfinished, part(index)), storage_options=self.storage_options,
            )

        summary = await self._fan_out(
            r=from_round, phase="tail", step="tail", items=items, sizes=size, make_task=make,
            failed_entry=self.layout.tail_failed_entry, after=split,
            input_url=self.layout.pending(from_round), output_url=self.layout.tail_output, total_records=sum(sizes.values()),
        )
        data = summary.as_dict()
        data["from_round"] = from_round
        await asyncio.to_thread(self.ledger.write, "tail", data)
        return summary

    # -- step: finalize -------------------------------------------------------------

    async def finalize(self) -> RunSummary:
        """Write exhausted rows if the rounds hit their cap, check conservation, record the run."""
        return await asyncio.to_thread(self._finalize)

    def _recorded(self) -> tuple[int, list[PhaseSummary], list[Decision], PhaseSummary | None]:
        """What the ledger holds: rounds inferred, their phases (+ the tail's), decisions, the tail."""
        phases: list[PhaseSummary] = []
        decisions: list[Decision] = []
        r = 0
        while (infer := self._phase_done(f"round-{r:02d}-infer")) is not None:
            phases.append(infer)
            if (judge := self._phase_done(f"round-{r:02d}-judge")) is not None:
                phases.append(judge)
            if (d := self.ledger.read(f"round-{r:02d}-decision")) is not None:
                decisions.append(Decision.from_dict(d))
            r += 1
        tail_data = self.ledger.read("tail")
        tail = PhaseSummary.from_dict(tail_data) if tail_data else None
        if tail:
            phases.append(tail)
        return r, phases, decisions, tail

    def quarantined(self) -> list[dict[str, Any]]:
        """Every quarantined shard entry of the run (``shard``, ``error``, ``records``, ...)."""
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
        quarantined = [q for p in phases for q in p.quarantined]
        if quarantined:
            sources.append(IdSource("failed", tuple(q["shard"] for q in quarantined), is_dir=False))
        return sources

    def _finalize(self) -> RunSummary:
        t0 = time.perf_counter()
        shard = ShardSummary.from_dict(self._require("shard", "run shard() first"))
        _, phases, decisions, tail = self._recorded()
        last = decisions[-1] if decisions else None
        if self.spec.strategy == "in_place" or (last and last.kind == "tail"):
            if tail is None:
                raise StepOrderError(f"run {self.spec.run!r}: the tail has not run yet: run tail() first")
        elif last is None or last.kind not in ("done", "exhausted"):
            raise StepOrderError(f"run {self.spec.run!r}: the rounds have not finished (last decision: {last and last.kind})")
        exhausted = 0
        if last is not None and last.kind == "exhausted" and not tail:
            exhausted = passes.write_exhausted(
                [self.layout.rejected(last.round)], self.layout.exhausted, round=last.round, storage_options=self.storage_options,
                failed_dst=self.layout.failed_records(last.round),
            )
        report = check_conservation(self.terminal_sources(), input_records=shard.records, storage_options=self.storage_options)
        t = report["terminal"]
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
        )
        self.ledger.write("run", summary.as_dict())
        if not report["ok"]:
            raise ConservationError(
                f"run {self.spec.run!r}: conservation failed: {report['missing']} missing, {report['extra']} extra, "
                f"{report['duplicate_results']} duplicated in results (input {report['input']} of {shard.records}); "
                f"e.g. {report['examples'][:5]}"
                + (f"; unreadable (damaged in storage): {report['unreadable']}" if report.get("unreadable") else ""), report,
            )
        if exhausted:
            log.warning("run %s: %d record(s) exhausted max_rounds: see %s", self.spec.run, exhausted, self.layout.exhausted)
        return summary


def _per_worker(phase: PhaseSummary, fallback: int) -> float:
    """Engine time per worker that ran the phase (endpoints and k8s discovery need not match
    ``pool.replicas``); ``fallback`` only for ledgers written before workers were recorded."""
    return phase.engine_busy_s / max(1, phase.workers or fallback)


def _gap(phase: PhaseSummary) -> float:
    """Time in a phase when not even its longest task ran: dispatch and bookkeeping (one-wave bound)."""
    return max(0.0, phase.wall_s - phase.longest_task_s) if phase.shards_run else 0.0


async def drive(run: PipelineRun) -> RunSummary:
    """Call the steps in sequence; every step resumes, so this is also the resume path."""
    await run.shard()
    if run.spec.strategy == "in_place":
        await run.tail(0)
        return await run.finalize()
    r = 0
    while True:
        await run.infer(r)
        await run.judge(r)
        decision = await asyncio.to_thread(run.decide, r)
        if decision.kind == "next_round":
            await run.recompact(r)
            r += 1
            continue
        if decision.kind == "tail":
            await run.recompact(r)
            await run.tail(r + 1)
        break
    return await run.finalize()


async def drive_retrying(run: PipelineRun, *, retries: int = 5, backoff_s: float = 1.0) -> RunSummary:
    """``drive``, resumed after a transient storage/network error (steps are idempotent).

    Waits ``backoff_s``, doubling, up to ``retries`` times (defaults ride out ~30 s of
    object-store outage), then lets the error through: the run stops, a re-run resumes.
    """
    for attempt in range(retries + 1):
        try:
            return await drive(run)
        except Exception as exc:
            if attempt >= retries or not is_transient(exc):
                raise
            wait = backoff_s * 2**attempt
            log.warning("run %s: transient error (%s: %s); resuming in %.1fs (%d/%d)",
                        run.spec.run, type(exc).__name__, exc, wait, attempt + 1, retries)
            await asyncio.sleep(wait)
    raise AssertionError("unreachable")


async def run_pipeline(
    spec: PipelineSpec, *, runner: TaskRunner | None = None, reporter: Reporter | None = None,
    retries: int = 5, backoff_s: float = 1.0,
) -> RunSummary:
    """Run (or resume) a whole pipeline; opens a runner from ``spec.pool`` when none is given.

    Transient storage errors resume the run after a backoff (``retries``, ``backoff_s``).
    The spec is proven first (``preflight``: judge built, the first records rendered
    through infer and judge), so a spec error stops the run before the pool spends anything.
    """
    from batch_inference.pipeline.preflight import preflight

    await asyncio.to_thread(preflight, spec)
    if runner is not None:
        return await drive_retrying(PipelineRun(spec, runner, reporter=reporter), retries=retries, backoff_s=backoff_s)
    from batch_inference.pipeline.runner import open_runner

    async with open_runner(spec) as opened:
        return await drive_retrying(PipelineRun(spec, opened, reporter=reporter), retries=retries, backoff_s=backoff_s)


_NEEDS_RUNNER = {"infer", "judge", "tail"}


def run_step(spec: PipelineSpec, step: str, *args: Any) -> Any:
    """Blocking helper: run one step (opening a runner when the step needs one)."""

    async def go() -> Any:
        if step not in _NEEDS_RUNNER:
            fn = getattr(PipelineRun(spec), step)
            res = fn(*args)
            return await res if asyncio.iscoroutine(res) else res
        from batch_inference.pipeline.runner import open_runner

        async with open_runner(spec) as runner:
            return await getattr(PipelineRun(spec, runner), step)(*args)

    if step not in ("shard", "infer", "judge", "decide", "recompact", "tail", "finalize"):
        raise ValueError(f"unknown step {step!r}")
    return asyncio.run(go())
