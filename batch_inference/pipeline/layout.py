"""Every URL of one pipeline run, in one place (docs/ARCHITECTURE.md "Data layout").

Everything a run writes lives under ``<base>/<run>/``, so two runs with different names
never collide, and a re-run of the same spec finds its own earlier outputs (resume).
Shard ``i`` of a phase keeps index ``i`` through the round (pending part-i -> inferred
part-i -> approved/rejected part-i), so a step can tell which shards are already done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from batch_inference.storage.urls import join, normalize

SUFFIX = ".jsonl.zst"


def part(index: int, prefix: str = "part") -> str:
    """The shard file name for index ``index`` (sorts in index order)."""
    return f"{prefix}-{index:05d}{SUFFIX}"


@dataclass(frozen=True)
class RunLayout:
    """The URLs and names of run ``run`` under ``base``. Pure: builds strings, touches nothing.

    The only source of the run's file, ledger-entry, progress and task-id names.
    """

    base: str
    run: str

    SHARD: ClassVar[str] = "shard"  # run-level ledger entries
    SHARD_INPUT: ClassVar[str] = "shard-input"  # the input resharded (before the layout pass): what a resume starts from
    SHARD_STREAM: ClassVar[str] = "shard-stream"  # round 0 began beside the layout pass: the run instance its tasks carry
    TAIL: ClassVar[str] = "tail"
    RUN: ClassVar[str] = "run"
    SPEC: ClassVar[str] = "spec"
    INPUT_SCHEMA: ClassVar[str] = "input-schema"  # the input's format and (Parquet) Arrow schema, recorded at sharding
    SPEC_FOLDERS: ClassVar[str] = "spec-folders"  # the fingerprints of the spec's model and adapter folders' files
    PLAN: ClassVar[str] = "plan"  # what the planner expected (batch-inference plan --record, the Dagster start job)

    def __post_init__(self) -> None:
        if not self.run or "/" in self.run or self.run in (".", ".."):
            raise ValueError(f"run name {self.run!r} must be a single path segment")
        object.__setattr__(self, "base", normalize(self.base))

    @property
    def root(self) -> str:
        return join(self.base, self.run)

    # -- sharding (CPU, once) -------------------------------------------------------
    @property
    def sharded(self) -> str:
        return join(self.root, "sharded")

    @property
    def layout_spill(self) -> str:
        """The layout pass's sorted runs while it sorts (removed when it ends)."""
        return join(self.root, "layout-spill")

    @property
    def export_spill(self) -> str:
        """The Parquet export's sorted runs while it puts rows back in input order (removed when it ends)."""
        return join(self.root, "export-spill")

    @property
    def input_quarantine(self) -> str:
        """Malformed input lines found at sharding: ``{file, line, reason, raw}`` each."""
        return join(self.root, "quarantine", "input.jsonl")

    # -- rounds ---------------------------------------------------------------------
    def round_dir(self, r: int) -> str:
        return join(self.root, f"round-{r:02d}")

    def pending(self, r: int) -> str:
        """Round ``r``'s input: the sharded input for round 0, recompacted rejects after."""
        return self.sharded if r == 0 else join(self.round_dir(r), "pending")

    def inferred(self, r: int) -> str:
        return join(self.round_dir(r), "inferred")

    def rejected(self, r: int) -> str:
        return join(self.round_dir(r), "rejected")

    def failed(self, r: int) -> str:
        """Quarantine: one ``{phase}-part-i.jsonl`` entry per shard whose task exhausted retries."""
        return join(self.round_dir(r), "failed")

    def failed_entry(self, r: int, phase: str, index: int) -> str:
        return join(self.failed(r), f"{phase}-part-{index:05d}.jsonl")

    def failed_records(self, r: int) -> str:
        """Rejected records of round ``r`` whose error is permanent (``status: failed``, reason)."""
        return join(self.round_dir(r), "failed-records")

    # -- human review (a round whose judge escalates to people) ------------------------
    def review_dir(self, r: int) -> str:
        return join(self.round_dir(r), "review")

    def review_queue(self, r: int) -> str:
        """Rows waiting for a human verdict (``status: awaiting_review``), one shard per judge shard."""
        return join(self.review_dir(r), "queue")

    def verdicts(self, r: int) -> str:
        """The append-only verdict log: one small segment per write, never rewritten."""
        return join(self.review_dir(r), "verdicts")

    def leases(self, r: int) -> str:
        """One JSON object per record a reviewer holds (expires; removed on verdict)."""
        return join(self.review_dir(r), "leases")

    REVIEWED_REJECTED_PREFIX = "review-"

    @staticmethod
    def reviewed_prefix(r: int) -> str:
        """The name prefix of round ``r``'s human-approved shards in ``results/`` (within ``approved_prefix``)."""
        return f"round-{r:02d}-review-"

    def reviewed_approved_shard(self, r: int, index: int) -> str:
        return join(self.results, part(index, f"{self.reviewed_prefix(r)}part"))

    def reviewed_rejected_shard(self, r: int, index: int) -> str:
        """Beside the judge's rejected shards: the next round (or the tail) takes them alike."""
        return join(self.rejected(r), part(index, f"{self.REVIEWED_REJECTED_PREFIX}part"))

    def approved_shard(self, r: int, index: int) -> str:
        """Approved rows go straight into results (no copy pass), named by round."""
        return join(self.results, part(index, f"{self.approved_prefix(r)}part"))

    @staticmethod
    def approved_prefix(r: int) -> str:
        """The name prefix of round ``r``'s approved shards in ``results/``."""
        return f"round-{r:02d}-"

    # -- tail (Strategy 2) ----------------------------------------------------------
    @property
    def tail(self) -> str:
        return join(self.root, "tail")

    @property
    def tail_output(self) -> str:
        """Rows with ``status`` approved | max_attempts | error, one shard per pending shard."""
        return join(self.tail, "output")

    def tail_checkpoint(self, index: int) -> str:
        """Per-sample, per-attempt checkpoint store of tail shard ``index``."""
        return join(self.tail, "checkpoints", f"part-{index:05d}")

    def tail_judge_waves(self, index: int) -> str:
        """Tail shard ``index``'s judge waves on the judge's own pool (scratch, removed once read)."""
        return join(self.tail, "judge-waves", f"part-{index:05d}")

    @property
    def tail_failed(self) -> str:
        return join(self.tail, "failed")

    def tail_failed_entry(self, index: int) -> str:
        return join(self.tail_failed, f"retry-part-{index:05d}.jsonl")

    @property
    def tail_unfinished(self) -> str:
        """Tail rows that ended ``max_attempts`` or ``error`` (split from tail output)."""
        return join(self.tail, "unfinished")

    def tail_approved_shard(self, index: int) -> str:
        return join(self.results, part(index, "tail-part"))

    # -- terminal sets --------------------------------------------------------------
    @property
    def results(self) -> str:
        """Every approved record, once."""
        return join(self.root, "results")

    @property
    def exhausted(self) -> str:
        """Records still rejected when ``max_rounds`` was hit (rounds strategy)."""
        return join(self.root, "exhausted")

    @property
    def parquet_export(self) -> str:
        """``batch-inference export --format parquet``: part-NNNNN.parquet files."""
        return join(self.root, "export", "parquet")

    @property
    def openai_export(self) -> str:
        """``batch-inference export --format openai_batch``: output.jsonl + errors.jsonl."""
        return join(self.root, "export", "openai_batch")

    # -- ledger ---------------------------------------------------------------------
    @property
    def ledger(self) -> str:
        return join(self.root, "ledger")

    def ledger_file(self, name: str) -> str:
        return join(self.ledger, f"{name}.json")

    @staticmethod
    def step_name(r: int, step: str) -> str:
        """A round step's ledger entry (and progress folder) name: ``round-00-infer``.

        ``step`` is infer, judge or decision of round ``r``, or recompact (the entry of the
        pass that made pending(r)), or review-open / review-seal / review (its human review:
        opened, sealed, closed). The run-level entries are ``shard``, ``tail``, ``run``
        and ``spec`` (``SHARD``, ``TAIL``, ``RUN``, ``SPEC``).
        """
        return f"round-{r:02d}-{step}"

    def task_id(self, r: int, kind: str, index: int, *, instance: str) -> str:
        """The pool's idempotency key of a shard task.

        ``instance`` is the run instance (``ShardSummary.instance``, new each time the input
        is sharded afresh): a resume of the run sends the same ids (a worker may answer a
        finished task from memory), while the same run name sharded again after its
        output was deleted sends new ones, which no worker has answered before.
        """
        return f"{self.phase_key(r, kind, instance=instance)}/{index:05d}"

    def phase_key(self, r: int, kind: str, *, instance: str) -> str:
        """One phase of one run instance: its task ids' prefix, and the scope within which
        a worker computes identical requests once (``TaskSpec.dedup_scope``)."""
        return f"{self.run}/{instance}/r{r:02d}/{kind}" if instance else f"{self.run}/r{r:02d}/{kind}"

    @property
    def progress_root(self) -> str:
        return join(self.ledger, "progress")

    def progress_dir(self, step: str) -> str:
        return join(self.progress_root, step)

    @staticmethod
    def progress_name(index: int) -> str:
        return f"part-{index:05d}.json"

    def progress_file(self, step: str, index: int) -> str:
        """One small record per finished shard task: the resume marker of that shard."""
        return join(self.progress_dir(step), self.progress_name(index))

    @property
    def live_root(self) -> str:
        return join(self.ledger, "live")

    def live_dir(self, step: str) -> str:
        return join(self.live_root, step)

    def live_progress_file(self, step: str, index: int) -> str:
        """What shard task ``index`` of ``step`` reports while it runs (``TaskSpec.progress_url``):
        records done so far, replaced after each chunk; its progress record supersedes it."""
        return join(self.live_dir(step), f"part-{index:05d}.jsonl")
