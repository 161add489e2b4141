"""``review_age`` (WARN): the oldest record of a round's review queue is not older than ``review.warn_after``.

Evaluated when the round is judged (a fresh queue passes) and re-evaluated by the round
sensor on its ticks while the queue waits (``review_age_evaluation``), so the warning
appears on the round's ``rejected`` asset as the queue ages, without a run.
"""


from typing import Any

import dagster as dg

from batch_inference.defs.keys import DEFAULT, REJECTED, PipelineKeys
from batch_inference.defs.partitions import parse_round_key
from batch_inference.defs.specs import load_spec
from batch_inference.defs.storage.resources import StorageResource

CHECK_NAME = "review_age"


def _verdict(status: dict[str, Any] | None, warn_after: float) -> tuple[bool, str, dict[str, Any]]:
    if status is None:
        return True, "no review queue in this round", {}
    age = float(status["oldest_age_s"])
    meta = {"oldest_age_s": dg.MetadataValue.float(round(age, 1)), "left": dg.MetadataValue.int(int(status["left"])),
            "warn_after_s": dg.MetadataValue.float(warn_after)}
    if age > warn_after:
        return False, f"oldest waiting record is {age / 3600:.1f} h old (warn after {warn_after / 3600:.1f} h); {status['left']} left", meta
    return True, f"{status['left']} waiting, oldest {age:.0f} s", meta


def review_age_evaluation(status: dict[str, Any], warn_after: float, partition: str, rejected: dg.AssetKey = REJECTED) -> dg.AssetCheckEvaluation:
    """The same check as an event the sensor reports while the queue waits."""
    passed, text, meta = _verdict(status, warn_after)
    return dg.AssetCheckEvaluation(asset_key=rejected, check_name=CHECK_NAME, passed=passed, severity=dg.AssetCheckSeverity.WARN,
                                   description=text, metadata=meta, partition=partition)


def build_review_check(k: PipelineKeys) -> dg.AssetChecksDefinition:
    """``review_age`` on pipeline ``k``'s ``rejected``, per round partition."""

    @dg.asset_check(asset=k.rejected, name=CHECK_NAME, partitions_def=k.rounds, description=(
        "WARN when the oldest record waiting for human review is older than review.warn_after (re-evaluated by the round sensor)"))
    def review_age(context: dg.AssetCheckExecutionContext, storage: StorageResource) -> dg.AssetCheckResult:
        from batch_inference.pipeline import PipelineRun
        from batch_inference.review.lifecycle import ReviewGate

        key = parse_round_key(context.op_execution_context.partition_key)
        spec = load_spec(context.instance, key.run, storage, k.source)
        run = PipelineRun(spec, gate=ReviewGate())
        status = run.review_status(key.round).as_dict() if run.needs_review(key.round) else None
        passed, text, meta = _verdict(status, spec.review.warn_after)
        return dg.AssetCheckResult(passed=passed, severity=dg.AssetCheckSeverity.WARN, description=text, metadata=meta)

    return review_age


review_age = build_review_check(DEFAULT)
