"""The round gate: what a round's human review is to the pipeline (docs/ARCHITECTURE.md "the gate seam").

A judge that sends records to people (``judge.escalate``, ``judge.kind: human``) leaves its
round waiting at a gate. The pipeline knows three things about a gate: it is opened once the
judge has written the round's queue, its status says where the round stands, and it is
resolved once people (or the timeout policy) decided every record, writing the reviewed rows
beside the judge's. ``RoundGate`` is that seam; ``batch_inference.review`` implements it over
its verdict log (``review.ReviewGate``) and the composition roots (CLI, Dagster steps, API)
wire it in. The names and types both sides share live here, below both: the ledger entries
of a review, its status, and the errors a gate raises.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from batch_inference.pipeline.layout import RunLayout
from batch_inference.pipeline.ledger import Ledger
from batch_inference.pipeline.summaries import ReviewSummary, _Summary
from batch_inference.rows import Status

if TYPE_CHECKING:
    from batch_inference.pipeline.spec import PipelineSpec

__all__ = ["AWAITING_REVIEW", "ReviewClosed", "ReviewPending", "ReviewStatus", "ReviewSummary", "RoundGate", "closing",
           "default_gate", "ledger_closing", "ledger_open", "ledger_resolved", "ledger_seal", "opened"]

AWAITING_REVIEW = Status.AWAITING_REVIEW.value


class ReviewPending(RuntimeError):
    """The round's review queue is not empty (and its timeout policy does not decide it yet)."""


class ReviewClosed(RuntimeError):
    """The round's review is sealed: no verdict can change it any more."""


def ledger_open(r: int) -> str:
    return RunLayout.step_name(r, "review-open")


def ledger_closing(r: int) -> str:
    return RunLayout.step_name(r, "review-closing")


def ledger_seal(r: int) -> str:
    return RunLayout.step_name(r, "review-seal")


def ledger_resolved(r: int) -> str:
    return RunLayout.step_name(r, "review")


def closing(ledger: Ledger, r: int) -> bool:
    """Whether round ``r``'s review is closing or closed: no verdict is taken any more.

    A close that finds a record undecided in what it read (an undo landed as it began)
    does not seal: it overwrites its marker with ``reopened`` and the round is open again.
    """
    marker = ledger.read(ledger_closing(r))
    return marker is not None and not marker.get("reopened")


def opened(ledger: Ledger, r: int) -> dict[str, object] | None:
    return ledger.read(ledger_open(r))


@dataclass(frozen=True)
class ReviewStatus(_Summary):
    """Where a round's review stands (cheap enough for a sensor tick: the log, not the queue)."""

    round: int
    awaiting_in: int  # records the judge sent to people
    decided: int
    left: int
    approved: int
    rejected: int
    by_reviewer: dict[str, int]
    conflicts: int
    opened_at: float
    oldest_age_s: float  # of the oldest record still waiting (0 when none waits)
    policy: str  # e.g. "after 172800s: reject", "wait for people"
    due: bool  # the timeout has passed and the policy decides the rest
    resolvable: bool  # resolve() would close the round now
    resolved: bool
    reopened: int = 0  # times a close found an undo in what it read and reopened the round

    @property
    def text(self) -> str:
        if self.resolved:
            return "review finished"
        if self.left == 0:
            return "review queue empty"
        if self.due:
            return f"review timed out: {self.policy} ({self.left} left)"
        return f"waiting for review ({self.left} left)"


class RoundGate(Protocol):
    """A round's human review as the pipeline drives it (blocking calls: run them off the loop)."""

    def open(self, spec: PipelineSpec, layout: RunLayout, ledger: Ledger, r: int, records: int) -> None:
        """The judge sent ``records`` of round ``r`` to people: the round waits from now on."""

    def status(self, spec: PipelineSpec, layout: RunLayout, ledger: Ledger, r: int, *,
               now: float | None = None) -> ReviewStatus:
        """Where round ``r``'s review stands."""

    def resolve(self, spec: PipelineSpec, layout: RunLayout, ledger: Ledger, r: int, *,
                now: float | None = None) -> ReviewSummary:
        """Close round ``r``'s review (idempotent); :class:`ReviewPending` while records wait."""


# The gate a run gets when whoever builds it wires none (library use: ``run_pipeline(spec)``).
# Named, not imported: the pipeline sits below ``review`` and never imports it; the CLI, the
# Dagster steps and the API pass ``review.ReviewGate()`` themselves.
LIBRARY_GATE = "batch_inference.review.lifecycle:ReviewGate"


def default_gate() -> RoundGate:
    """The library's gate, loaded by name (only once a round actually waits for people)."""
    module, _, name = LIBRARY_GATE.partition(":")
    gate: RoundGate = getattr(importlib.import_module(module), name)()
    return gate
