"""The review domain's definitions: closing a round's human review."""

from __future__ import annotations

import dagster as dg

from batch_inference.defs.jobs import PipelineJobs, build_jobs
from batch_inference.defs.keys import DEFAULT, PipelineKeys
from batch_inference.defs.review.assets import build_review_asset
from batch_inference.defs.review.checks import build_review_check


def build_definitions(k: PipelineKeys = DEFAULT, jobs: PipelineJobs | None = None) -> dg.Definitions:
    """``reviewed``, the ``review_age`` check and ``review_job`` (the round sensor requests it)."""
    return dg.Definitions(assets=[build_review_asset(k)], asset_checks=[build_review_check(k)], jobs=[(jobs or build_jobs(k)).review])
