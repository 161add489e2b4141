"""The round policy: what follows a judged round, and the hybrid's crossover. Pure.

``decide_round`` reads only a spec and a round's ``PhaseSummary`` figures, so the
orchestrator (``PipelineRun.decide``, from the ledger) and the scale simulation
(``planning.simulation``, in virtual time) decide with the same code. It imports only
the spec and the summaries: no storage, no pool, no planning.

The hybrid's crossover keeps re-dispatching rounds while they pay, then hands over.

Decided after each round from that round's own measured figures. Per round ``r`` with
``P`` records in, ``R`` rejected, wall ``W`` (infer + judge) and engine time ``B`` (per
worker):

* approval ``a = approved / judged``; shrink ``= 1 - R / P``.
* per-record cost of an attempt ``c = B / P`` (the engine's time is what work costs);
* fixed cost of a round ``F = W - B`` + the last recompaction: the engine idles while a
  phase ramps up and drains (the latency chain of its slowest records) and while the
  driver dispatches, writes and repacks. Of it, ``O`` is what in-place retry does not
  pay per attempt: the recompaction plus each phase's dispatch gaps (phase wall minus
  its longest task). The rest, the latency chain, in-place pays too: its slowest record
  still takes one infer -> judge trip per attempt.
* ``n`` = rounds still needed (until fewer than one record is expected, at most the
  rounds and attempts left); ``S = sum_{j<n} (1-a)^j`` record-attempts per rejected
  record by rounds, ``E = (1 - (1-a)^k) / a`` with ``k`` attempts left in place.
* by rounds: ``n F + c R S`` (plus, when ``max_rounds`` stops the rounds before the
  attempts run out, the tail the hybrid then runs: ``f c R (1-a)^n E'`` with the attempts
  left after them); in place: ``n F - (n - 1) O + f c R E`` where
  ``f = in_place_cost_factor`` is what one in-place record-attempt costs relative to a
  round's (per-sample loop, checkpoints, chunk stragglers; ``bench/strategies.py``
  measures it on this machine).

Switch when ``shrink < min_shrink`` (off by default) or (``compare_cost``) rounds cost
more. So per-round overheads that a persistent pool does not remove (a scheduler, slow
object storage, big recompactions) move the crossover earlier, as the reference says;
when rounds are cheap, the hybrid keeps to rounds.
"""

from __future__ import annotations

import math
from typing import Any

from batch_inference.pipeline.spec import CrossoverRule, PipelineSpec
from batch_inference.pipeline.summaries import Decision, PhaseSummary


def expected_attempts(approval: float, attempts_left: int) -> float:
    """Mean attempts a record still needs, capped at ``attempts_left``."""
    if attempts_left <= 0:
        return 0.0
    if approval <= 0:
        return float(attempts_left)
    return (1 - (1 - approval) ** attempts_left) / approval


def choose_crossover(
    rule: CrossoverRule,
    *,
    round: int,
    records_in: int,
    approved: int,
    rejected: int,
    wall_s: float,
    engine_s: float,
    overhead_s: float = 0.0,
    recompact_s: float = 0.0,
    rounds_left: int,
    attempts_left: int,
) -> tuple[bool, str, dict[str, Any]]:
    """Whether to hand the pending set to in-place retry after ``round``; with the reason and figures.

    ``overhead_s`` is the phases' dispatch gaps (part of ``wall_s - engine_s``);
    ``recompact_s`` the last recompaction's wall (the next round's would be similar).
    """
    judged = approved + rejected
    approval = approved / judged if judged else 0.0
    shrink = 1 - rejected / records_in if records_in else 1.0
    busy = min(engine_s, wall_s)
    fixed = wall_s - busy + recompact_s
    avoidable = min(fixed, max(0.0, overhead_s) + recompact_s)
    per_record = busy / records_in if records_in else 0.0
    factor = rule.in_place_cost_factor
    e = expected_attempts(approval, attempts_left)
    if 0 < approval < 1 and rejected > 1:
        needed = math.ceil(math.log(1 / rejected) / math.log(1 - approval))
    else:
        needed = attempts_left if approval == 0 else 1
    n = max(0, min(rounds_left, attempts_left, needed))
    s = sum((1 - approval) ** j for j in range(n))
    cost_rounds = n * fixed + per_record * rejected * s
    # a hybrid stopped by max_rounds before its attempts run out hands the rest to the tail:
    # project that too, or rounds look cheaper than they are (bench/reports/scale_sim.md)
    rest = rejected * (1 - approval) ** n if 0 < approval < 1 else 0.0
    if rounds_left < attempts_left and n == rounds_left and rest >= 1:
        cost_rounds += factor * per_record * rest * expected_attempts(approval, attempts_left - n)
    cost_in_place = n * fixed - max(0, n - 1) * avoidable + factor * per_record * rejected * e
    figures = {
        "round": round,
        "records_in": records_in,
        "approved": approved,
        "rejected": rejected,
        "approval": round_(approval),
        "shrink": round_(shrink),
        "min_shrink": rule.min_shrink,
        "wall_s": round_(wall_s),
        "engine_s": round_(busy),
        "fixed_s": round_(fixed),
        "avoidable_s": round_(avoidable),
        "per_record_s": per_record,
        "in_place_cost_factor": factor,
        "expected_attempts": round_(e),
        "rounds_projected": n,
        "projected_rounds_s": round_(cost_rounds),
        "projected_in_place_s": round_(cost_in_place),
    }
    if round + 1 < rule.min_rounds:
        return False, f"round {round + 1} of at least {rule.min_rounds} before the rule applies", figures
    if shrink < rule.min_shrink:
        return True, f"pending set shrank {shrink:.1%} < {rule.min_shrink:.0%}", figures
    if rule.compare_cost and cost_rounds > cost_in_place:
        return True, versus(cost_rounds, cost_in_place), figures
    # say which rule kept the rounds going: only the rules that are on decided
    kept = [f"shrank {shrink:.1%} >= {rule.min_shrink:.0%}"] if rule.min_shrink > 0 else []
    if rule.compare_cost:
        kept.append(versus(cost_rounds, cost_in_place))
    else:
        a, b = _distinct(cost_rounds, cost_in_place)
        kept.append(f"cost comparison off (projected rounds {a}s, in-place {b}s)")
    return False, "rounds go on: " + "; ".join(kept), figures


def _distinct(a: float, b: float, *, most: int = 6) -> tuple[str, str]:
    """``a`` and ``b`` with the fewest decimals (2 up to ``most``) at which they read apart."""
    for digits in range(2, most + 1):
        fa, fb = f"{a:.{digits}f}", f"{b:.{digits}f}"
        if fa != fb:
            return fa, fb
    return fa, fb


def versus(rounds_s: float, in_place_s: float) -> str:
    """The cost comparison as a reason that reads true: each figure with as many decimals as
    it takes to tell them apart ("projected rounds 0.91s > in-place 0.91s" read as a
    contradiction), or, where they agree to the microsecond, that they are equal (a tie keeps the rounds)."""
    a, b = _distinct(rounds_s, in_place_s)
    if a != b:
        return f"projected rounds {a}s {'>' if rounds_s > in_place_s else '<'} in-place {b}s"
    if rounds_s > in_place_s:
        return f"projected rounds {a}s > in-place by {rounds_s - in_place_s:.1e}s"
    return f"projected rounds {rounds_s:.2f}s = in-place {in_place_s:.2f}s (equal to the microsecond: a tie keeps the rounds)"


def round_(x: float) -> float:
    return float(f"{x:.4g}")


def decide_round(spec: PipelineSpec, r: int, infer: PhaseSummary, judge: PhaseSummary, *, recompact_s: float = 0.0,
                 reviewed: dict[str, Any] | None = None) -> Decision:
    """What follows round ``r`` given its two phases' figures (pure: ``PipelineRun.decide``
    reads them from the ledger; the scale simulation builds them in virtual time).
    ``recompact_s`` is the last recompaction's wall (the next one's estimate); ``reviewed``
    the round's closed human review (``ReviewSummary.as_dict()``), whose verdicts count too."""
    # A rejected row with a permanent error fails wherever it goes next (recompaction or the
    # run's end route it to failed): only the rest is left to retry.
    failed = judge.permanent_errors
    approved, rejected = judge.approved, max(0, judge.rejected - failed)
    more_figures: dict[str, Any] = {"failed": failed} if failed else {}
    if reviewed is not None:
        approved, rejected = approved + int(reviewed["approved"]), rejected + int(reviewed["rejected"])
        more_figures = {"reviewed": int(reviewed["records"]), "reviewed_approved": int(reviewed["approved"]),
                        "reviewed_rejected": int(reviewed["rejected"]), "review_timed_out": int(reviewed["timed_out"])}
    records_in = infer.records_total
    rounds_left = spec.max_rounds - (r + 1)
    attempts_left = spec.max_attempts - (r + 1)
    figures: dict[str, Any] = {"records_in": records_in, "approved": approved, "rejected": rejected,
                               "quarantined": infer.records_quarantined + judge.records_quarantined,
                               "rounds_left": rounds_left, "attempts_left": attempts_left, **more_figures}
    if not spec.judged:  # one inference per record: every rejection is a failed inference, none is retried
        failed = judge.rejected
        figures.update(rejected=0, failed=failed)
        kind, reason = "done", f"no judge: {approved} inferred and approved" + (f", {failed} failed" if failed else "")
    elif rejected == 0:
        kind, reason = "done", f"nothing left to retry ({failed} failed permanently)" if failed else "nothing rejected"
    elif attempts_left <= 0:
        kind, reason = "exhausted", f"max_attempts ({spec.max_attempts}) reached with {rejected} rejected"
    elif spec.strategy == "hybrid" and spec.judge.kind == "human":
        # No in-place tail for a human judge (nobody can approve inside a worker): rounds only.
        if rounds_left <= 0:
            kind, reason = "exhausted", f"max_rounds ({spec.max_rounds}) reached with {rejected} rejected (human judge: no in-place tail)"
        else:
            kind, reason = "next_round", f"{rejected} rejected (human judge: rounds only)"
    elif spec.strategy == "hybrid":
        switch, reason, more = choose_crossover(
            spec.crossover, round=r, records_in=records_in, approved=approved, rejected=rejected,
            wall_s=infer.wall_s + judge.wall_s,
            engine_s=_per_worker(infer, spec.pool.replicas) + _per_worker(judge, spec.pool.replicas),
            overhead_s=_gap(infer) + _gap(judge), recompact_s=recompact_s,
            rounds_left=rounds_left, attempts_left=attempts_left,
        )
        figures.update(more)
        if switch or rounds_left <= 0:
            kind = "tail"
            reason = reason if switch else f"max_rounds ({spec.max_rounds}) reached: {rejected} to in-place retry"
        else:
            kind = "next_round"
    elif rounds_left <= 0:
        kind, reason = "exhausted", f"max_rounds ({spec.max_rounds}) reached with {rejected} still rejected"
    else:
        kind, reason = "next_round", f"{rejected} rejected"
    return Decision(round=r, kind=kind, reason=reason, figures=figures)  # type: ignore[arg-type]


def _per_worker(phase: PhaseSummary, fallback: int) -> float:
    """Engine time per worker that ran the phase (endpoints and k8s discovery need not match
    ``pool.replicas``); ``fallback`` only for a ledger without ``workers``."""
    return phase.engine_busy_s / max(1, phase.workers or fallback)


def _gap(phase: PhaseSummary) -> float:
    """Time in a phase when not even its longest task ran: dispatch and bookkeeping (one-wave bound)."""
    return max(0.0, phase.wall_s - phase.longest_task_s) if phase.shards_run else 0.0
