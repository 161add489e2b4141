"""What each pipeline step returns and records in the ledger.

Small frozen dataclasses of plain JSON values: the ledger stores ``as_dict()``, the CLI
report and the Dagster metadata read their fields.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

DecisionKind = Literal["next_round", "tail", "done", "exhausted"]
# quarantined: a shard task exhausted its retries (infrastructure); exhausted: max_rounds or
# max_attempts hit; records_failed: only records with a permanent error (bad input) failed.
RunStatus = Literal["converged", "exhausted", "quarantined", "records_failed"]


class _Summary:
    def as_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class ShardSummary(_Summary):
    """The one CPU pass over the input."""

    input_url: str
    output_url: str
    records: int
    shards: int
    ids_assigned: int
    duplicate_ids: int
    duplicate_examples: list[str]
    wall_s: float
    resumed: bool = False
    malformed: int = 0  # input lines quarantined at sharding (see RunLayout.input_quarantine)
    input_format: str = "jsonl"  # "jsonl" (native records) or "openai_batch" (converted at sharding)


@dataclass(frozen=True)
class PhaseSummary(_Summary):
    """One fan-out of shard tasks: a round's infer or judge phase, or the tail."""

    round: int
    phase: Literal["infer", "judge", "tail"]
    input_url: str
    output_url: str
    shards: int
    shards_run: int  # tasks run by this call (the rest were already done: resumed)
    records_in: int
    counts: dict[str, int]
    tokens_in: int
    tokens_out: int
    engine_busy_s: float
    wall_s: float
    drain_s: float  # from the last task's start to the phase's end: the final wave
    avg_fill: float
    cached_tasks: int  # tasks the pool replayed by task id
    task_retries: int = 0  # tasks re-sent after a failure (as counted by the runner, e.g. PoolClient.retried)
    longest_task_s: float = 0.0  # the longest task's wall: wall - this = the driver's dispatch gaps (one wave)
    quarantined: list[dict[str, Any]] = field(default_factory=list)  # {shard, phase, error, records}
    workers: int = 0  # distinct workers that ran its tasks (0: recorded before this was)

    @property
    def records_quarantined(self) -> int:
        return sum(int(q.get("records", 0)) for q in self.quarantined)


@dataclass(frozen=True)
class RecompactSummary(_Summary):
    """Round ``round``'s rejected rows repacked into round ``round + 1``'s pending shards."""

    round: int
    input_url: str
    output_url: str
    records: int
    shards_in: int
    shards_out: int
    wall_s: float
    resumed: bool = False


@dataclass(frozen=True)
class Decision(_Summary):
    """What follows round ``round``, and the measured figures it was decided on."""

    round: int
    kind: DecisionKind
    reason: str
    figures: dict[str, Any]


@dataclass(frozen=True)
class RunSummary(_Summary):
    """The end of a run: terminal counts, the conservation check, the status."""

    run: str
    url: str
    strategy: str
    status: RunStatus
    records: int
    approved: int
    exhausted: int
    max_attempts: int
    failed: int
    rounds: int
    tail: bool
    results_url: str
    conservation: dict[str, Any]
    tokens_in: int
    tokens_out: int
    engine_busy_s: float
    wall_s: float
    quarantined: int = 0  # of ``failed``: records of shards quarantined (the rest: record errors)
