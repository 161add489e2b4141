"""What each pipeline step returns and records in the ledger, and the ledger read back typed.

One import path for both halves: the step records live in ``pipeline.step_summaries`` (small
frozen dataclasses of plain JSON values, ``as_dict``/``from_dict``), the ledger read back
(``RoundView``, ``LedgerView``, ``JudgedRound``, ``StepOutcome``) in ``pipeline.ledger_view``.
"""

from __future__ import annotations

from batch_inference.pipeline.ledger_view import (
    JudgedRound,
    LedgerView,
    RoundView,
    StepOutcome,
    StepProgress,
    add_counts,
)
from batch_inference.pipeline.step_summaries import (
    ConservationReport,
    Decision,
    DecisionKind,
    LayoutSummary,
    PhaseSummary,
    QuarantineEntry,
    RecompactSummary,
    ReviewSummary,
    RunStatus,
    RunSummary,
    ShardSummary,
    _Summary,
    cache_hit_rate,
    prefill_vs_ideal,
    rate,
)

__all__ = [
    "ConservationReport", "Decision", "DecisionKind", "JudgedRound", "LayoutSummary", "LedgerView", "PhaseSummary",
    "QuarantineEntry", "RecompactSummary", "ReviewSummary", "RoundView", "RunStatus", "RunSummary", "ShardSummary",
    "StepOutcome", "StepProgress", "_Summary", "add_counts", "cache_hit_rate", "prefill_vs_ideal", "rate",
]
