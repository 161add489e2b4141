"""Human review at the round boundary: the verdict log and its fold (verdicts), the round's
review as the pipeline opens and resolves it (lifecycle), the live queue a review server
serves (queue), and the review page itself (server, static/: ``batch-inference review``).

Names are imported lazily so the pipeline's use of ``lifecycle`` does not pull in the
queue, and nothing here pulls in the server's aiohttp.
"""

from __future__ import annotations

from batch_inference._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "COMPACT_EVERY": "batch_inference.review.verdicts",
    "ReviewLog": "batch_inference.review.verdicts",
    "Fold": "batch_inference.review.verdicts",
    "fold": "batch_inference.review.verdicts",
    "verdict_entry": "batch_inference.review.verdicts",
    "undo_entry": "batch_inference.review.verdicts",
    "AWAITING_REVIEW": "batch_inference.review.lifecycle",
    "TIMEOUT_REVIEWER": "batch_inference.review.lifecycle",
    "ReviewPending": "batch_inference.review.lifecycle",
    "ReviewClosed": "batch_inference.review.lifecycle",
    "ReviewStatus": "batch_inference.review.lifecycle",
    "ReviewSummary": "batch_inference.review.lifecycle",
    "ledger_open": "batch_inference.review.lifecycle",
    "ledger_closing": "batch_inference.review.lifecycle",
    "ledger_seal": "batch_inference.review.lifecycle",
    "closing": "batch_inference.review.lifecycle",
    "ledger_resolved": "batch_inference.review.lifecycle",
    "opened": "batch_inference.review.lifecycle",
    "status": "batch_inference.review.lifecycle",
    "open_queue": "batch_inference.review.lifecycle",
    "queue_rows": "batch_inference.review.lifecycle",
    "keyed_rows": "batch_inference.review.lifecycle",
    "review_keys": "batch_inference.review.lifecycle",
    "resolve": "batch_inference.review.lifecycle",
    "ReviewGate": "batch_inference.review.lifecycle",
    "ReviewQueue": "batch_inference.review.queue",
    "Item": "batch_inference.review.queue",
    "Lease": "batch_inference.review.queue",
    "Outcome": "batch_inference.review.queue",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
