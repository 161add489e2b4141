"""Per-round checks, recounted from storage (not from what the steps reported).

- ``round_conservation`` (blocking): pending = inferred + infer-quarantined and
  inferred = approved + rejected + awaiting review + judge-quarantined, every count streamed from the
  round's shards. Blocking: the round's run fails, and the round sensor never advances a
  failed round, so a wrong round cannot feed the next one.
- ``quarantine_empty`` (WARN): no shard of the round was quarantined.
"""

from typing import Any

import dagster as dg

from batch_inference.defs.keys import DEFAULT, PipelineKeys
from batch_inference.defs.partitions import parse_round_key
from batch_inference.defs.specs import load_spec
from batch_inference.defs.storage.resources import StorageResource


def round_counts(spec: Any, r: int) -> dict[str, int]:
    """Every count of round ``r``, streamed from its shards (``PipelineRun.round_counts``)."""
    from batch_inference.pipeline import PipelineRun

    return PipelineRun(spec).round_counts(r)


def build_round_checks(k: PipelineKeys) -> list[dg.AssetChecksDefinition]:
    """The per-round checks of pipeline ``k``, partitioned like its rounds."""

    @dg.asset_check(asset=k.rejected, name="round_conservation", blocking=True, partitions_def=k.rounds, description=(
        "pending = inferred + quarantined(infer) and inferred = approved + rejected + awaiting review + quarantined(judge), streamed from storage"))
    def round_conservation(context: dg.AssetCheckExecutionContext, storage: StorageResource) -> dg.AssetCheckResult:
        key = parse_round_key(context.op_execution_context.partition_key)
        spec = load_spec(context.instance, key.run, storage, k.source)
        try:
            c = round_counts(spec, key.round)
        except (OSError, ValueError) as exc:  # a shard listed but unreadable is a failed check, named
            return dg.AssetCheckResult(passed=False, description=f"round {key.round_label} of {key.run}: cannot recount: {exc}")
        infer_ok = c["pending"] == c["inferred"] + c["infer_quarantined"]
        judge_ok = c["inferred"] == c["approved"] + c["rejected"] + c["awaiting"] + c["judge_quarantined"]
        problems = []
        if not infer_ok:
            problems.append(f"pending {c['pending']} != inferred {c['inferred']} + quarantined {c['infer_quarantined']}")
        if not judge_ok:
            problems.append(f"inferred {c['inferred']} != approved {c['approved']} + rejected {c['rejected']} + awaiting review "
                            f"{c['awaiting']} + quarantined {c['judge_quarantined']}")
        return dg.AssetCheckResult(
            passed=not problems,
            description="; ".join(problems) or f"round {key.round_label}: every record accounted for",
            metadata={k: dg.MetadataValue.int(v) for k, v in c.items()},
        )


    @dg.asset_check(asset=k.failed, name="quarantine_empty", partitions_def=k.rounds, description="No shard of the round was quarantined (WARN: the run goes on, the records are reported failed)")
    def quarantine_empty(context: dg.AssetCheckExecutionContext, storage: StorageResource) -> dg.AssetCheckResult:
        from batch_inference.pipeline import Ledger, RunLayout

        key = parse_round_key(context.op_execution_context.partition_key)
        spec = load_spec(context.instance, key.run, storage, k.source)
        view = Ledger(RunLayout(spec.output, spec.run), spec.storage_options).view()
        entries = view.rounds[key.round].quarantined if key.round < len(view.rounds) else []
        return dg.AssetCheckResult(
            passed=not entries,
            severity=dg.AssetCheckSeverity.WARN,
            description=f"{len(entries)} quarantined shard(s)" if entries else "nothing quarantined",
            metadata={"shards": dg.MetadataValue.int(len(entries)),
                      "records": dg.MetadataValue.int(sum(q.records for q in entries)),
                      "entries": dg.MetadataValue.json([q.as_dict() for q in entries[:20]])},
        )

    return [round_conservation, quarantine_empty]


round_conservation, quarantine_empty = build_round_checks(DEFAULT)
