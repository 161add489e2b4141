"""Review progress as Dagster metadata (pure: from ``ReviewStatus`` / ``ReviewSummary`` dicts)."""

from __future__ import annotations

from typing import Any

import dagster as dg


def review_page(url: str, run: str, r: int) -> dg.MetadataValue:
    """The link to the round on the review page (``batch-inference review`` serves it)."""
    return dg.MetadataValue.url(f"{url.rstrip('/')}/?round={r}#run={run}")


def progress_metadata(status: dict[str, Any], *, url: str, run: str) -> dict[str, Any]:
    """Awaiting, done, by verdict, by reviewer, age of the oldest waiting record, the page."""
    r = int(status["round"])
    return {
        "review_awaiting": dg.MetadataValue.int(int(status["left"])),
        "review_done": dg.MetadataValue.int(int(status["decided"])),
        "review_total": dg.MetadataValue.int(int(status["awaiting_in"])),
        "review_approved": dg.MetadataValue.int(int(status["approved"])),
        "review_rejected": dg.MetadataValue.int(int(status["rejected"])),
        "review_conflicts": dg.MetadataValue.int(int(status["conflicts"])),
        "review_oldest_age_s": dg.MetadataValue.float(round(float(status["oldest_age_s"]), 1)),
        "review_by_reviewer": dg.MetadataValue.json(dict(status["by_reviewer"])),
        "review_policy": dg.MetadataValue.text(str(status["policy"])),
        "review_page": review_page(url, run, r),
    }
