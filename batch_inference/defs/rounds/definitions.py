"""The rounds domain's definitions: Strategy 1 rounds and the sensor that drives every run."""

from __future__ import annotations

import dagster as dg

from batch_inference.defs.jobs import round_job
from batch_inference.defs.rounds.assets import inferred, judge, pending
from batch_inference.defs.rounds.checks import quarantine_empty, round_conservation
from batch_inference.defs.rounds.sensors import round_sensor


def build_definitions() -> dg.Definitions:
    """A round's assets (pending -> inferred -> approved/rejected/failed), its checks, its job, the round sensor."""
    return dg.Definitions(
        assets=[pending, inferred, judge],
        asset_checks=[round_conservation, quarantine_empty],
        jobs=[round_job],
        sensors=[round_sensor],
    )
