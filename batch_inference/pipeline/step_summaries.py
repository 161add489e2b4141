"""What each pipeline step returns and records in the ledger, and the run's figures.

(``pipeline.summaries`` re-exports these with the ledger read back, ``pipeline.ledger_view``.)

Small frozen dataclasses of plain JSON values: the ledger stores ``as_dict()`` and reads
them back with ``from_dict``; the CLI report, the Dagster metadata and the checks read
their fields and properties, so a derived figure (a round's input, its quarantined
records, its approval rate) is computed here once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Literal

from batch_inference.pool.protocol import PERMANENT_ERRORS

DecisionKind = Literal["next_round", "tail", "done", "exhausted"]
# quarantined: a shard task exhausted its retries (infrastructure); exhausted: max_rounds or
# max_attempts hit; records_failed: only records with a permanent error (bad input) failed.
RunStatus = Literal["converged", "exhausted", "quarantined", "records_failed"]


class _Summary:
    _nested: ClassVar[dict[str, Any]] = {}  # field -> how to rebuild it from JSON

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Any:
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        kwargs = {k: v for k, v in data.items() if k in names}
        for name, build in cls._nested.items():
            if name in kwargs and kwargs[name] is not None:
                kwargs[name] = build(kwargs[name])
        return cls(**kwargs)


def rate(num: float, den: float) -> float:
    """``num / den`` rounded for display, 0 when there is nothing to divide."""
    return round(num / den, 4) if den else 0.0


@dataclass(frozen=True)
class QuarantineEntry(_Summary):
    """A shard whose task exhausted its retries: its records all count as failed."""

    shard: str
    phase: str
    error: str
    records: int
    task_id: str = ""
    round: int = 0


def _entries(items: list[Any]) -> list[QuarantineEntry]:
    return [q if isinstance(q, QuarantineEntry) else QuarantineEntry.from_dict(q) for q in items]


@dataclass(frozen=True)
class ConservationReport(_Summary):
    """Every input id against every terminal row (``ledger.check_conservation``)."""

    ok: bool
    input: int
    terminal: dict[str, int]
    missing: int
    extra: int
    duplicate_results: int
    examples: list[str]
    unreadable: list[str]
    method: str
    # the failed rows by what they failed with (``ledger.failure_kind``), most first: what
    # ``run`` and ``status`` name (a ledger written before it has none)
    failed_reasons: dict[str, int] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:  # report["ok"] reads as the ledger's JSON of it does
        return getattr(self, key)


@dataclass(frozen=True)
class LayoutSummary(_Summary):
    """The prefix-aware layout pass over the sharded input (``pipeline.placement``).

    Blocks are the signatures' (``block_size`` tokens each, the first ``max_blocks`` of a
    request). ``shared_input`` counts the blocks each record shares with the record before
    it in input order, ``shared_sorted`` the same in prefix order: what a cache that holds
    only the last request's prefix would save either way; ``gain`` is their difference
    over ``blocks``. ``applied`` says whether the records were rewritten in prefix order
    (``reason`` why or why not). The figures are the final signature's: the model's tokens
    when the first pass (by text, ``text_gain``) found the order worth it, else the text's.
    """

    applied: bool
    reason: str
    signature: str  # what the tokens were: the model's tokenizer, or text
    block_size: int
    max_blocks: int
    records: int
    blocks: int
    shared_input: int
    shared_sorted: int
    gain: float
    sign_s: float  # rendering + tokenising + hashing (with workers: their wall, reading and spilling included)
    sort_s: float  # spilling, merging, rewriting
    runs: int  # spilled sorted runs (0: the records sorted in memory)
    merge_levels: int
    text_gain: float = 0.0  # the first pass's gain, signing by text: below min_gain nothing is tokenised
    # shard boundaries inside a prefix family: the records either side share more than the
    # blocks every record shares (placement.shard_cuts: a family larger than its window)
    cuts_shared: int = 0
    common_blocks: int = 0  # leading blocks every record shares (a preamble): families lie past them
    workers: int = 1  # processes the passes signed in (placement.layout_workers)
    # the text pass's characters a token (measured with the model's tokenizer on a sample of the
    # run's prompts; 4 for the simulated engine): a resumed run's signer signs text at this figure
    chars_per_token: float = 0.0


@dataclass(frozen=True)
class ShardSummary(_Summary):
    """The one CPU pass over the input."""

    _nested: ClassVar[dict[str, Any]] = {"layout": LayoutSummary.from_dict}

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
    malformed_examples: list[str] = field(default_factory=list)  # ``file:line`` of the first few (``pipeline.accounting``)
    quarantine_url: str = ""  # where the malformed lines are kept (RunLayout.input_quarantine), when there are any
    input_format: str = "jsonl"  # "jsonl" (native records) or "openai_batch" (converted at sharding)
    # The run instance: drawn when the input is sharded, part of every task id (RunLayout.task_id);
    # empty in a ledger without the field.
    instance: str = ""
    layout: LayoutSummary | None = None  # the prefix-aware layout (None: layout.prefix off)


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
    quarantined: list[QuarantineEntry] = field(default_factory=list)
    workers: int = 0  # distinct workers that ran its tasks (0: a ledger without the field)
    warnings: list[str] = field(default_factory=list)  # what its tasks reported (TaskResult.warnings)
    # "Is the engine full?": what it delivered, and its own occupancy sampled while the phase
    # ran (streaming engines: mean running/waiting/in-flight, summed over workers; KV use
    # averaged). utilization (engine_busy_s / wall_s) and avg_fill only say it was fed.
    output_tokens_per_s: float = 0.0
    engine: dict[str, Any] = field(default_factory=dict)
    # where it ran: pool, model and adapter (the tail: its judge's too), as the spec places it
    ran_on: dict[str, Any] = field(default_factory=dict)
    # Requests answered by an identical request of the phase on the same worker (pool.dedup),
    # and the prompt/output tokens the engine did not compute for them: tokens_in/out
    # count every record's tokens, the engine computed tokens - duplicate_tokens.
    duplicates: int = 0
    duplicate_tokens_in: int = 0
    duplicate_tokens_out: int = 0
    # The engine's prefix cache over the requests it ran (vLLM's per-request cached tokens):
    # prompt tokens looked up, and those found cached.
    prefix_queried: int = 0
    prefix_hits: int = 0
    # The ideal prefill: each distinct prefix of the phase computed once (distinct cacheable
    # blocks over every worker, a merged sketch: ~1.6% error, plus the tokens past them);
    # None where the engine keeps no prefix cache.
    ideal_prefill_tokens: int | None = None
    # The cross-run result cache (pool.result_cache): deterministic requests looked up, those
    # an earlier run's results answered (no engine work), and the requests the engine ran.
    result_cache_lookups: int = 0
    result_cache_hits: int = 0
    engine_requests: int = 0

    _nested: ClassVar[dict[str, Any]] = {"quarantined": _entries}

    @property
    def result_cache_hit_rate(self) -> float | None:
        """Requests answered from the result cache / looked up (None: nothing looked up)."""
        return rate(self.result_cache_hits, self.result_cache_lookups) if self.result_cache_lookups else None

    def __post_init__(self) -> None:
        object.__setattr__(self, "quarantined", _entries(list(self.quarantined)))

    @property
    def records_quarantined(self) -> int:
        return sum(q.records for q in self.quarantined)

    @property
    def records_total(self) -> int:
        """Every record the phase was given: those its tasks read plus those of quarantined shards."""
        return self.records_in + self.records_quarantined

    @property
    def approved(self) -> int:
        return int(self.counts.get("approved", 0))

    @property
    def rejected(self) -> int:
        """Rows in the phase's rejected shards (for a judge, its permanent errors included)."""
        return int(self.counts.get("rejected", 0))

    @property
    def records_failed(self) -> int:
        """Records that ended failed in the phase: its quarantined shards' and (the tail) its errors."""
        return self.records_quarantined + int(self.counts.get("error", 0))

    @property
    def max_attempts(self) -> int:
        """Records that used every attempt (the tail): unfinished, not failed."""
        return int(self.counts.get("max_attempts", 0))

    @property
    def permanent_errors(self) -> int:
        """Of a judge's rejected rows, those with a permanent error: they end ``failed``, never retried."""
        return int(self.counts.get(PERMANENT_ERRORS, 0))

    @property
    def prefix_hit_rate(self) -> float | None:
        """Prompt tokens the engine's prefix cache supplied / looked up (None: no engine said)."""
        return rate(self.prefix_hits, self.prefix_queried) if self.prefix_queried else None

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the engine computed (its prefix-cache misses)."""
        return self.prefix_queried - self.prefix_hits

    @property
    def prefill_vs_ideal(self) -> float | None:
        """Prefill computed / the ideal (1.0: every distinct prefix computed exactly once)."""
        return rate(self.prefill_tokens, self.ideal_prefill_tokens) if self.ideal_prefill_tokens and self.prefix_queried else None


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
    # shards cut between prefix families (placement.FamilyCuts: layout.prefix and the shard
    # step's layout applied) rather than by count, and the cuts whose records either side
    # still share a leading block (as the shard step's layout.cuts_shared)
    families: bool = False
    cuts_shared: int = 0


@dataclass(frozen=True)
class Decision(_Summary):
    """What follows round ``round``, and the measured figures it was decided on."""

    round: int
    kind: DecisionKind
    reason: str
    figures: dict[str, Any]


@dataclass(frozen=True)
class ReviewSummary(_Summary):
    """A closed human review (``round-NN-review``): what people and the timeout policy decided."""

    round: int
    records: int
    approved: int
    rejected: int
    by_reviewer: dict[str, int]
    by_verdict: dict[str, int]
    timed_out: int  # decided by the timeout policy
    conflicts: int
    conflict_examples: list[dict[str, Any]]
    segments: int
    sealed_at: float
    wall_s: float


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
    conservation: ConservationReport
    tokens_in: int
    tokens_out: int
    engine_busy_s: float
    wall_s: float
    quarantined: int = 0  # of ``failed``: records of shards quarantined (the rest: record errors)
    # The cross-run result cache over every phase (inference and judge requests): looked up,
    # answered from it, requests the engines ran; and the store after this run's trim
    # (``pool.result_cache.TrimReport``; empty: the cache is off).
    result_cache_lookups: int = 0
    result_cache_hits: int = 0
    engine_requests: int = 0
    result_cache: dict[str, Any] = field(default_factory=dict)

    _nested: ClassVar[dict[str, Any]] = {"conservation": ConservationReport.from_dict}

    @property
    def result_cache_hit_rate(self) -> float | None:
        """Requests answered from the result cache / looked up (None: nothing looked up)."""
        return rate(self.result_cache_hits, self.result_cache_lookups) if self.result_cache_lookups else None

    def __post_init__(self) -> None:
        if isinstance(self.conservation, Mapping):
            object.__setattr__(self, "conservation", ConservationReport.from_dict(self.conservation))

    @property
    def unfinished(self) -> int:
        """Records that ran out of rounds or attempts."""
        return self.exhausted + self.max_attempts


def cache_hit_rate(phases: list[PhaseSummary]) -> float | None:
    """Prompt tokens the engines' prefix caches supplied / looked up, over phases (None: none said)."""
    queried = sum(p.prefix_queried for p in phases)
    return rate(sum(p.prefix_hits for p in phases), queried) if queried else None


def prefill_vs_ideal(phases: list[PhaseSummary]) -> float | None:
    """Prompt tokens prefilled / the ideal (each distinct prefix once), over the phases that know it."""
    known = [p for p in phases if p.ideal_prefill_tokens and p.prefix_queried]
    return rate(sum(p.prefill_tokens for p in known), sum(p.ideal_prefill_tokens or 0 for p in known)) if known else None
