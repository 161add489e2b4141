"""The review domain's definitions: closing a round's human review."""

from __future__ import annotations

import dagster as dg

from batch_inference.defs.jobs import review_job
from batch_inference.defs.review.assets import reviewed
from batch_inference.defs.review.checks import review_age


def build_definitions() -> dg.Definitions:
    """``reviewed``, the ``review_age`` check and ``review_job`` (the round sensor requests it)."""
    return dg.Definitions(assets=[reviewed], asset_checks=[review_age], jobs=[review_job])
