"""A run against its plan while it goes: the ETA after each round, and planned vs actual walls."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from batch_inference.pipeline.layout import RunLayout
from batch_inference.pipeline.spec import PipelineSpec
from batch_inference.pipeline.summaries import PhaseSummary
from batch_inference.planning.cluster import Cluster
from batch_inference.planning.plan import local_overheads
from batch_inference.planning.rates import EngineRates, Workload
from batch_inference.planning.simulation import LAYOUT_PHASE, simulate


def eta_after_round(spec: PipelineSpec, r: int, infer: PhaseSummary, judge: PhaseSummary, decision_kind: str,
                    *, recompact_s: float = 0.0) -> float:
    """Seconds the run still needs after round ``r`` was decided, from this round's own
    measured throughput and the pending set (the scale simulation over what is left)."""
    rejected = judge.rejected
    if decision_kind in ("done", "exhausted") or rejected <= 0:
        return 0.0
    workers = max(1, infer.workers or spec.pool.replicas)
    per_infer = infer.wall_s * workers / max(1, infer.records_in)
    per_judge = judge.wall_s * workers / max(1, judge.records_in)
    judged = judge.approved + rejected
    a = judge.approved / judged if judged else 0.5
    rates = EngineRates(infer_s=per_infer, judge_s=per_judge, infer_latency_s=0.0, judge_latency_s=0.0,
                        infer_tokens_out=infer.tokens_out / max(1, infer.records_in), steps_per_record=0.0,
                        calls_per_record=0.0, scheduling="measured", profile=f"round {r}")
    left = spec.model_copy(update={
        "strategy": "in_place" if decision_kind == "tail" else spec.strategy,
        "max_rounds": max(1, spec.max_rounds - (r + 1)), "max_attempts": max(1, spec.max_attempts - (r + 1)),
    })
    w = Workload(records=rejected, approval=a)
    cluster = Cluster(replicas=workers, concurrency=spec.pool.concurrency * (spec.pool.replicas if workers == 1 else 1))
    o = dataclasses.replace(local_overheads(spec), task_s=0.0, phase_launch_s=0.0, reshard_records_per_s=float("inf"),
                            recompact_records_per_s=(rejected / recompact_s) if recompact_s > 0 else 110_000.0)
    return simulate(left, w, rates, cluster=cluster, overheads=o).wall_s


class PhaseVsPlan(NamedTuple):
    """One phase's planned and actual wall. ``priced``: the plan priced it from a measurement
    or a calibrated profile; an unpriced phase's planned wall is a guess (``plan.assumed_phases``),
    so no ratio is drawn against it."""

    name: str
    planned: float | None
    actual: float | None
    priced: bool = True

    def ratio(self) -> float | None:
        """actual / planned, where both are there and the phase was priced."""
        if not self.priced or not self.planned or self.actual is None:
            return None
        return self.actual / self.planned


def planned_vs_actual(plan: dict[str, Any], phases: list[tuple[str, float]]) -> list[PhaseVsPlan]:
    """Each phase's planned and actual wall for a recorded plan (``RunPlan.as_dict``) and measured phases."""
    chosen = next((s for s in plan.get("strategies", []) if s["strategy"] == plan.get("chosen")), None)
    recorded = (chosen or {}).get("phases", [])
    planned = {p["name"]: float(p["wall_s"]) for p in recorded}
    priced = {p["name"]: bool(p.get("priced", True)) for p in recorded}
    actual = dict(phases)
    names = list(planned) + [n for n in actual if n not in planned]
    return [PhaseVsPlan(n, planned.get(n), actual.get(n), priced.get(n, True)) for n in names]


def measured_phases(ledger: Any) -> list[tuple[str, float]]:
    """(phase, wall s) of a run as its ledger recorded them, named as the plan names them."""
    out = []
    if (s := ledger.read(RunLayout.SHARD)) is not None:
        laid = s.get("layout") or {}
        layout_s = float(laid.get("sign_s", 0.0)) + float(laid.get("sort_s", 0.0))
        out.append(("shard (reshard input, CPU)", float(s["wall_s"]) - layout_s))
        if laid:
            out.append((LAYOUT_PHASE, layout_s))
    r = 0
    while (inf := ledger.read(RunLayout.step_name(r, "infer"))) is not None:
        out.append((f"round {r} infer", float(inf["wall_s"])))
        if (j := ledger.read(RunLayout.step_name(r, "judge"))) is not None:
            out.append((f"round {r} judge", float(j["wall_s"])))
        if (rc := ledger.read(RunLayout.step_name(r + 1, "recompact"))) is not None:
            out.append((f"round {r} recompact", float(rc["wall_s"])))
        r += 1
    if (t := ledger.read(RunLayout.TAIL)) is not None:
        out.append(("tail", float(t["wall_s"])))
    return out
