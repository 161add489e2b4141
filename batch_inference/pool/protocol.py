"""Wire types between the pipeline and the workers: plain JSON, pydantic, no pickle.

A task is a *reference*: it names an input shard and output URLs; records never travel
in a request. The same types are used in-process (``InProcessPool``) and over HTTP
(``PoolClient`` -> worker), so the pipeline cannot tell the two apart.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from batch_inference.judges import JudgeConfig
from batch_inference.prompting import InferConfig, SamplingConfig, derive_seed  # re-exported: the wire carries them

TaskKind = Literal["infer", "judge", "retry"]
# How a task hands a chunk's requests to the engine: ``input``, in the shard's order;
# ``prefix``, sorted by prompt (requests sharing a prefix side by side) and admitted as
# one run that other tasks' requests do not interleave (docs/pipeline.md "Order and placement").
SubmitOrder = Literal["input", "prefix"]

# Output keys each kind writes (see docs/ARCHITECTURE.md "Shard tasks").
OUTPUT_KEYS: dict[str, frozenset[str]] = {
    "infer": frozenset({"output"}),
    "judge": frozenset({"approved", "rejected"}),
    "retry": frozenset({"output", "checkpoint"}),
}
# A judge that escalates to people (or a human judge) also writes the round's review queue.
REVIEW_OUTPUT = "review"
# A retry task with this output judges on the worker's judge pool (the judge's own model):
# each wave goes there as a judge task whose input and outputs lie under this folder.
# Without it the retry task judges on its own worker's engine.
JUDGE_POOL_OUTPUT = "judge_pool"
# A judge count beside approved / rejected: how many of its rejected rows carry a permanent
# error (rows.permanent_error). They stay in the rejected shard (recompaction ends them
# ``failed``), so the round that saw them fail can count them as failed.
PERMANENT_ERRORS = "permanent_errors"

class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TaskSpec(_Wire):
    """One shard task. ``outputs`` keys depend on ``kind`` (``OUTPUT_KEYS``).

    ``storage_options_ref`` names a storage profile in
    the *worker's* own configuration: credentials never travel in a request.
    """

    task_id: str = Field(min_length=1, max_length=512)
    kind: TaskKind
    input_url: str = Field(min_length=1)
    outputs: dict[str, str]
    infer: InferConfig | None = None
    judge: JudgeConfig | None = None
    max_attempts: int = Field(1, ge=1)
    chunk_size: int = Field(2000, ge=1)
    round: int = Field(0, ge=0)
    storage_options_ref: str | None = None
    # Identical deterministic requests of tasks that share this scope (one phase: run
    # instance, round, kind) run once per worker (pool.dedup); None: every request runs.
    dedup_scope: str | None = Field(None, min_length=1, max_length=512)
    # The cross-run result cache's folder (pool.result_cache): deterministic requests found
    # there are answered from it, those computed are stored; None: no cache.
    result_cache: str | None = Field(None, min_length=1)
    # The prefix family of the shard's records (pipeline.affinity): a pool of several
    # workers sends one family's tasks to one worker while it has a free slot, so its
    # engine's prefix cache holds the family (pool.client). None: any worker.
    affinity: str | None = Field(None, min_length=1, max_length=128)
    order: SubmitOrder = "input"
    # Where the task reports how far it got while it runs (``pool.context.TaskContext.report_progress``):
    # one small JSON record, replaced after each committed chunk. None: no progress reported.
    progress_url: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _check_kind(self) -> TaskSpec:
        want = OUTPUT_KEYS[self.kind]
        if self.kind == "judge" and self.judge is not None and self.judge.reviews:
            want = want | {REVIEW_OUTPUT}
        if self.kind == "retry" and JUDGE_POOL_OUTPUT in self.outputs:
            want = want | {JUDGE_POOL_OUTPUT}
        if self.kind == "retry" and self.judge is not None and self.judge.kind == "human":
            raise ValueError(f"task {self.task_id!r}: in-place retry has no round boundary for a human judge to review at")
        if set(self.outputs) != want:
            raise ValueError(f"task {self.task_id!r}: kind {self.kind!r} needs outputs {sorted(want)}, got {sorted(self.outputs)}")
        if self.kind in ("infer", "retry") and self.infer is None:
            raise ValueError(f"task {self.task_id!r}: kind {self.kind!r} needs an infer config")
        if self.kind in ("judge", "retry") and self.judge is None:
            raise ValueError(f"task {self.task_id!r}: kind {self.kind!r} needs a judge config")
        return self

    def urls(self) -> list[str]:
        """Every URL the task reads or writes (for the worker's storage-root check)."""
        return [self.input_url, *self.outputs.values(), *([self.result_cache] if self.result_cache else []),
                *([self.progress_url] if self.progress_url else [])]

    def output_files(self) -> list[str]:
        """The output shards a finished task has committed (not the retry task's checkpoint store,
        nor the scratch folder of its judge waves)."""
        return [url for key, url in self.outputs.items() if key not in ("checkpoint", JUDGE_POOL_OUTPUT)]


class TaskResult(_Wire):
    """What a finished task reports; ``cached`` means an idempotent replay."""

    task_id: str
    kind: TaskKind
    worker: str
    counts: dict[str, int]
    records_in: int
    tokens_in: int = 0
    tokens_out: int = 0
    wall_s: float = 0.0
    engine_busy_s: float = 0.0
    avg_fill: float = 0.0
    # Requests answered by an identical one (pool.dedup), and the tokens the engine did not
    # compute for them (their rows carry their usage as if computed).
    duplicates: int = 0
    duplicate_tokens_in: int = 0
    duplicate_tokens_out: int = 0
    # The engine's prefix cache over the requests it ran (those whose engine reports it):
    # prompt tokens looked up, and those found cached (prefill computed = queried - hits).
    prefix_queried: int = 0
    prefix_hits: int = 0
    # The ideal prefill: the distinct cacheable blocks of the requests the engine ran (a
    # DistinctBlocks sketch, engines.blocks, merged over the phase), their block size, and
    # their tokens past those blocks (computed by every request).
    prefix_blocks: str | None = None
    prefix_block_size: int | None = None
    prefix_tail_tokens: int = 0
    # The cross-run result cache (pool.result_cache): deterministic requests looked up, those
    # answered from it (no engine work; their rows carry their usage), and the requests the
    # engine ran.
    result_cache_lookups: int = 0
    result_cache_hits: int = 0
    engine_requests: int = 0
    cached: bool = False
    warnings: list[str] = []  # e.g. checkpoint flushes that failed and were retried


class TaskFailed(Exception):
    """A task exhausted its retries; the caller quarantines ``spec`` (never requeues)."""

    def __init__(self, spec: TaskSpec, errors: list[str]) -> None:
        self.spec = spec
        self.errors = list(errors)
        last = self.errors[-1] if self.errors else "unknown error"
        super().__init__(f"task {spec.task_id} ({spec.kind} {spec.input_url}) failed after {len(self.errors)} attempt(s): {last}")


class TaskConflict(Exception):
    """The pool already holds this task id with a different spec: never the shard's fault.

    A task id names one task of one run instance, so the spec that built it changed while
    the run was under way (e.g. a resume with an edited template). Retrying cannot help and
    quarantining would blame the data: the run stops with this error for the user.
    """

    def __init__(self, spec: TaskSpec, detail: str) -> None:
        self.spec = spec
        super().__init__(
            f"task {spec.task_id}: {detail}. The run's spec changed after this run instance started: "
            "resume it with the spec it started with, or start it afresh (another run name, or delete the run's output)")


@runtime_checkable
class TaskRunner(Protocol):
    """What the pipeline drives: ``PoolClient`` (HTTP) and ``InProcessPool`` both fit."""

    @property
    def limit(self) -> int:  # replicas x concurrency: the dispatcher's in-flight cap
        ...

    @property
    def retried(self) -> int:  # tasks re-run after a failure so far (the ledger's task_retries)
        ...

    async def run_task(self, spec: TaskSpec) -> TaskResult:  # retried inside; raises TaskFailed (or TaskConflict)
        ...

    async def stats(self) -> dict[str, Any]:  # the engine's figures (occupancy, batcher); a pool's has "workers"
        ...


__all__ = ["JUDGE_POOL_OUTPUT", "OUTPUT_KEYS", "InferConfig", "SamplingConfig", "SubmitOrder", "TaskConflict", "TaskFailed", "TaskKind",
           "TaskResult", "TaskRunner", "TaskSpec", "derive_seed"]
