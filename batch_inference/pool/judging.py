"""How a task judges its rows: on the worker's own engine (``Judging``), or on the judge's
own pool (``PoolJudging``, a judge with a model of its own), one wave of rows at a time."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Sequence
from typing import Any

from batch_inference.engines import (
    Completion,
)
from batch_inference.judges import JudgeConfig, LLMJudge, Verdict, build_judge
from batch_inference.pool.context import TaskContext, TaskInputError
from batch_inference.pool.protocol import JUDGE_POOL_OUTPUT, TaskFailed, TaskSpec
from batch_inference.prompting import Request
from batch_inference.rows import ErrorKind, strip_results
from batch_inference.storage import urls

log = logging.getLogger(__name__)

# The automated "verdict" of a human judge: nothing decided yet.
HUMAN_REVIEW = "human_review"


class JudgePoolError(RuntimeError):
    """The judge pool could not judge a retry task's wave: the task fails as a whole (its
    checkpoints keep every record's progress), never a record."""


class Judging:
    """One task's judge: LLM judges go through the engine host (batcher or stream), rule judges run off-loop."""

    def __init__(self, ctx: TaskContext, config: JudgeConfig) -> None:
        self.ctx = ctx
        self.judge = build_judge(config) if config.kind != "human" else None
        self.escalate = config.escalate

    async def verdicts(self, records: Sequence[dict[str, Any]], results: Sequence[str],
                       attempts: Sequence[int] | None = None) -> list[Verdict]:
        """One verdict per record; ``attempts``: the attempt each result came from (pool.dedup)."""
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
        return self.judge is None or (self.escalate is not None and self.escalate.matches(verdict))

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
            storage_options_ref=ctx.spec.storage_options_ref, dedup_scope=ctx.spec.dedup_scope,
        )
        async with ctx.file(task.input_url).writer() as w:
            await w.write_many(rows)
        try:
            result = await self.runner.run_task(task)
        except TaskFailed as exc:
            raise JudgePoolError(f"task {ctx.spec.task_id}: the judge pool failed a wave of {len(rows)}: {exc}") from exc
        verdicts: list[Verdict | None] = [None] * len(rows)
        for key in ("approved", "rejected"):
            async for row in ctx.file(task.outputs[key]).iter_records():
                v = row.get("verdict")
                verdicts[int(row[_WAVE_POS])] = Verdict(**v) if v else Verdict(False, row.get("rejection") or "no_verdict")
        if any(v is None for v in verdicts):
            raise JudgePoolError(f"task {ctx.spec.task_id}: the judge pool returned {sum(v is not None for v in verdicts)} "
                                 f"of {len(rows)} verdicts for {folder}")
        ctx.meter.tokens_in += result.tokens_in
        ctx.meter.tokens_out += result.tokens_out
        await asyncio.to_thread(self._remove, folder)
        return verdicts  # type: ignore[return-value]

    def _remove(self, folder: str) -> None:
        try:
            fs, path = urls.fs_for(folder, self.ctx.storage_options)
            fs.rm(path, recursive=True)
        except (OSError, ValueError) as exc:  # scratch only: the verdicts are read
            log.warning("could not remove the judge wave folder %s: %s", folder, exc)


def judge_error(exc: BaseException) -> str:
    text = str(exc)
    if ErrorKind.of(text) is ErrorKind.MISSING_FIELD:
        return text
    return ErrorKind.JUDGE_ERROR.tag(f"{type(exc).__name__}: {text}")
