"""The hybrid's crossover: keep re-dispatching rounds while they pay, then hand over.

Decided after each round from that round's own measured figures (no guesses about the
engine). The model, per round ``r`` with ``P`` records in, ``R`` rejected, wall ``W``:

* approval ``a = approved / judged``; shrink ``= 1 - R / P``.
* fixed cost of a round ``F`` = the two phases' drains (the final wave, from the last
  task's start to the phase's end: the barrier in-place retry does not pay per round);
  per-record cost ``c = (W - F) / P``.
* with ``k`` attempts left per record, one record needs ``E = (1 - (1-a)^k) / a``
  more attempts on average (``k`` when ``a == 0``).
* finishing by rounds costs ``sum_j (F + c * R * (1-a)^j)`` over the rounds still
  needed (until fewer than one record is expected, at most the rounds left);
* finishing in place costs ``c * R * E + F * E``: the same per-attempt work without
  per-round barriers, but its final wave lasts ``E`` attempts (a chunk is done only
  when its slowest record is).

Switch when ``shrink < min_shrink`` or (``compare_cost``) rounds cost more than in-place.
"""

from __future__ import annotations

import math
from typing import Any

from batch_inference.pipeline.spec import CrossoverRule


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
    drain_s: float,
    rounds_left: int,
    attempts_left: int,
) -> tuple[bool, str, dict[str, Any]]:
    """Whether to hand the pending set to in-place retry after ``round``; with the reason and figures."""
    judged = approved + rejected
    approval = approved / judged if judged else 0.0
    shrink = 1 - rejected / records_in if records_in else 1.0
    fixed = min(drain_s, wall_s)
    per_record = (wall_s - fixed) / records_in if records_in else 0.0
    e = expected_attempts(approval, attempts_left)
    if 0 < approval < 1 and rejected > 1:
        needed = math.ceil(math.log(1 / rejected) / math.log(1 - approval))
    else:
        needed = attempts_left if approval == 0 else 1
    n_rounds = max(0, min(rounds_left, attempts_left, needed))
    cost_rounds = sum(fixed + per_record * rejected * (1 - approval) ** j for j in range(n_rounds))
    cost_in_place = per_record * rejected * e + fixed * e
    figures = {
        "round": round,
        "records_in": records_in,
        "approved": approved,
        "rejected": rejected,
        "approval": round_(approval),
        "shrink": round_(shrink),
        "min_shrink": rule.min_shrink,
        "wall_s": round_(wall_s),
        "fixed_s": round_(fixed),
        "per_record_s": per_record,
        "expected_attempts": round_(e),
        "rounds_projected": n_rounds,
        "projected_rounds_s": round_(cost_rounds),
        "projected_in_place_s": round_(cost_in_place),
    }
    if round + 1 < rule.min_rounds:
        return False, f"round {round + 1} of at least {rule.min_rounds} before the rule applies", figures
    if shrink < rule.min_shrink:
        return True, f"pending set shrank {shrink:.1%} < {rule.min_shrink:.0%}", figures
    if rule.compare_cost and cost_rounds > cost_in_place:
        return True, f"projected rounds {cost_rounds:.2f}s > in-place {cost_in_place:.2f}s", figures
    return False, f"rounds still pay: shrank {shrink:.1%}, projected rounds {cost_rounds:.2f}s <= in-place {cost_in_place:.2f}s", figures


def round_(x: float) -> float:
    return float(f"{x:.4g}")
