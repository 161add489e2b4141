"""How a task judges its rows: on the worker's own engine (``Judging``), or on the judge's
own pool (``PoolJudging``, a judge with a model of its own), one wave of rows at a time."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from batch_inference.engines import (
    Completion,
)
from batch_inference.judges import JudgeConfig, LLMJudge, Verdict, build_judge, judge_kind
from batch_inference.pool.context import TaskContext, TaskInputError
from batch_inference.pool.failures import JudgePoolError, is_machine_error
from batch_inference.pool.protocol import JUDGE_POOL_OUTPUT, TaskFailed, TaskSpec
from batch_inference.prompting import Request
from batch_inference.rows import ErrorKind, strip_results
from batch_inference.storage import urls

log = logging.getLogger(__name__)

# The automated "verdict" of a human judge: nothing decided yet.
HUMAN_REVIEW = "human_review"
# The verdict of ``judge: {kind: none}`` (a spec without a judge): every inferred record stands.
NO_JUDGE = "no_judge"


class Judging:
    """One task's judge: LLM judges go through the engine host (batcher or stream), rule judges run off-loop."""

    def __init__(self, ctx: TaskContext, config: JudgeConfig) -> None:
        self.ctx = ctx
        self.kind = config.kind
        self.judge = build_judge(config) if judge_kind(config.kind).build is not None else None
        self.escalate = config.escalate

    async def verdicts(self, records: Sequence[dict[str, Any]], results: Sequence[str],
                       attempts: Sequence[int] | None = None) -> list[Verdict]:
        """One verdict per record; ``attempts``: the attempt each result came from (pool.dedup)."""
        if self.kind == "none":  # no judge: every inferred record is approved, no model call
            return [Verdict(True, NO_JUDGE) for _ in records]
        if self.judge is None:  # a human judge: every record waits for a person
            return [Verdict(False, HUMAN_REVIEW) for _ in records]
        if isinstance(self.judge, LLMJudge):
            judge = self.judge
            requests: list[Request | BaseException] = []
            for record, result in zip(records, results):
                try:
                    requests.append(Request(judge.prompt(record, result), judge.sampling))
                except KeyError as exc:
                    requests.append(exc)
            done = await self.ctx.generate(requests, attempts)
            return [judge.verdict(c) if isinstance(c, Completion) else Verdict(False, judge_error(c)) for c in done]
        return await asyncio.to_thread(self._rules, list(records), list(results))

    def escalated(self, verdict: Verdict) -> bool:
        """Whether people decide this record (a human judge: always)."""
        return self.kind == "human" or (self.escalate is not None and self.escalate.matches(verdict))

    def _rules(self, records: list[dict[str, Any]], results: list[str]) -> list[Verdict]:
        assert self.judge is not None and not isinstance(self.judge, LLMJudge)
        out = []
        for record, result in zip(records, results):
            try:
                out.append(self.judge.judge(record, result))
            except Exception as exc:  # a rule that crashes on one record rejects that record only
                out.append(Verdict(False, judge_error(exc)))
        return out


# Where a row sat in its wave: the judge pool's approved / rejected split is read back by it
# (ids may repeat in an input; positions do not).
_WAVE_POS = "_judge_wave_pos"


class PoolJudging:
    """A retry task's judge on the worker's judge pool (the judge's own model).

    Each wave is one judge task there, by reference: the wave's rows go to a shard under
    the task's ``judge_pool`` folder, the judge pool splits them into approved / rejected
    as a round's judge does, and the verdicts are read back by position. The judge task's
    id carries a digest of the wave (ids and results), so a replay of this task gets the
    same verdicts and no other wave ever reuses them. Escalation is applied here, as on
    the worker's own engine: nobody reviews in place.
    """

    def __init__(self, ctx: TaskContext, config: JudgeConfig) -> None:
        if ctx.judge_runner is None:
            raise TaskInputError(f"task {ctx.spec.task_id} judges on a judge pool, but this worker has none "
                                 "(start it with --judge-endpoint, or run the judge on this engine)")
        self.ctx = ctx
        self.runner = ctx.judge_runner
        self.config = config.model_copy(update={"escalate": None})
        self.escalate = config.escalate
        self.base = ctx.spec.outputs[JUDGE_POOL_OUTPUT]

    def escalated(self, verdict: Verdict) -> bool:
        return self.escalate is not None and self.escalate.matches(verdict)

    async def verdicts(self, records: Sequence[dict[str, Any]], results: Sequence[str],
                       attempts: Sequence[int] | None = None) -> list[Verdict]:
        """One verdict per record; ``attempts`` go with the rows, so the judge pool's memo keys by them."""
        ctx = self.ctx
        rows = [{**strip_results(r), "result": res, "error": None, _WAVE_POS: i} for i, (r, res) in enumerate(zip(records, results))]
        if attempts is not None:
            for row, attempt in zip(rows, attempts):
                row["attempts"] = attempt
        digest = hashlib.blake2b(repr([(r["id"], r["result"]) for r in rows]).encode(), digest_size=8).hexdigest()
        folder = urls.join(self.base, digest)
        task = TaskSpec(
            task_id=f"{ctx.spec.task_id}/judge/{digest}", kind="judge", input_url=urls.join(folder, "input.jsonl.zst"),
            outputs={"approved": urls.join(folder, "approved.jsonl.zst"), "rejected": urls.join(folder, "rejected.jsonl.zst")},
            judge=self.config, chunk_size=ctx.spec.chunk_size, round=ctx.spec.round,
            storage_options_ref=ctx.spec.storage_options_ref, dedup_scope=ctx.spec.dedup_scope, result_cache=ctx.spec.result_cache,
        )
        async with _wave_files(ctx.spec.task_id, f"writing the wave of {len(rows)} to {task.input_url}"):
            async with ctx.file(task.input_url).writer() as w:
                await w.write_many(rows)
        try:
            # TaskConflict, a judge worker's full disk (OSError ENOSPC) and a dead judge engine
            # go up as they are: the run stops, as when the infer pool raises them
            result = await self.runner.run_task(task)
        except TaskFailed as exc:
            raise JudgePoolError(f"task {ctx.spec.task_id}: the judge pool failed a wave of {len(rows)}: {exc}") from exc
        try:
            verdicts = await self._read(task, len(rows), folder)
        except JudgePoolError:
            # the judge pool would answer a replay of this wave from the same files: gone, it judges it again
            await asyncio.to_thread(self._remove, folder)
            raise
        ctx.meter.tokens_in += result.tokens_in
        ctx.meter.tokens_out += result.tokens_out
        await asyncio.to_thread(self._remove, folder)
        return verdicts

    async def _read(self, task: TaskSpec, n: int, folder: str) -> list[Verdict]:
        """The wave's verdicts by position, from the judge task's approved / rejected split."""
        verdicts: list[Verdict | None] = [None] * n
        async with _wave_files(self.ctx.spec.task_id, f"reading the verdicts of a wave of {n} under {folder}"):
            for key in ("approved", "rejected"):
                async for row in self.ctx.file(task.outputs[key]).iter_records():
                    v = row.get("verdict")
                    verdicts[int(row[_WAVE_POS])] = Verdict(**v) if v else Verdict(False, row.get("rejection") or "no_verdict")
        if any(v is None for v in verdicts):
            raise JudgePoolError(f"task {self.ctx.spec.task_id}: the judge pool returned {sum(v is not None for v in verdicts)} "
                                 f"of {n} verdicts for {folder}")
        return verdicts  # type: ignore[return-value]

    def _remove(self, folder: str) -> None:
        try:
            fs, path = urls.fs_for(folder, self.ctx.storage_options)
            fs.rm(path, recursive=True)
        except (OSError, ValueError) as exc:  # scratch only: the verdicts are read
            log.warning("could not remove the judge wave folder %s: %s", folder, exc)


@contextlib.asynccontextmanager
async def _wave_files(task_id: str, doing: str) -> AsyncIterator[None]:
    """A wave's scratch files are the infrastructure's, never the task's input: an error
    writing or reading them (missing, corrupt, storage down) is a ``JudgePoolError`` (the
    task is retried), not the 422 of an unusable input; a full disk stays what it is (the
    run stops, ``failures.is_machine_error``)."""
    try:
        yield
    except OSError as exc:
        if is_machine_error(exc):
            raise
        raise JudgePoolError(f"task {task_id}: {doing}: {type(exc).__name__}: {exc}") from exc
    except (ValueError, KeyError, TypeError) as exc:  # a corrupt shard, a malformed row or verdict
        raise JudgePoolError(f"task {task_id}: {doing}: {type(exc).__name__}: {exc}") from exc


def judge_error(exc: BaseException) -> str:
    text = str(exc)
    if ErrorKind.of(text) is ErrorKind.MISSING_FIELD:
        return text
    return ErrorKind.JUDGE_ERROR.tag(f"{type(exc).__name__}: {text}")
