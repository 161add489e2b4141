"""The hybrid's crossover: keep re-dispatching rounds while they pay, then hand over.

Decided after each round from that round's own measured figures. Per round ``r`` with
``P`` records in, ``R`` rejected, wall ``W`` and engine time ``B`` (per worker):

* approval ``a = approved / judged``; shrink ``= 1 - R / P``.
* per-record cost of an attempt ``c = B / P`` (rounds are engine-bound; the engine's
  time is what the work costs), and the round's fixed cost ``F = W - B`` (engine idle:
  dispatch, the final wave, intermediate writes) plus the last recompaction's wall.
* with ``k`` attempts left per record, one record needs ``E = (1 - (1-a)^k) / a`` more
  attempts on average (``k`` when ``a == 0``).
* finishing by rounds costs ``sum_j (F + c * R * (1-a)^j)`` over the rounds still needed
  (until fewer than one record is expected, at most the rounds left);
* finishing in place costs ``f * c * R * E + F``: no per-round barriers, but each
  record-attempt costs ``f`` times a round's (``in_place_cost_factor``: the sample's
  own loop, its checkpoints and the chunk's straggler tail; calibrated by
  ``bench/strategies.py`` on this machine's simulated engine).

Switch when ``shrink < min_shrink`` (off by default) or (``compare_cost``) rounds cost
more than in-place. Large measured per-round overheads (a scheduler, a cold pool, slow
object storage) therefore move the crossover earlier, as the reference describes.
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
    engine_s: float,
    fixed_extra_s: float = 0.0,
    rounds_left: int,
    attempts_left: int,
) -> tuple[bool, str, dict[str, Any]]:
    """Whether to hand the pending set to in-place retry after ``round``; with the reason and figures."""
    judged = approved + rejected
    approval = approved / judged if judged else 0.0
    shrink = 1 - rejected / records_in if records_in else 1.0
    busy = min(engine_s, wall_s)
    fixed = wall_s - busy + fixed_extra_s
    per_record = busy / records_in if records_in else 0.0
    factor = rule.in_place_cost_factor
    e = expected_attempts(approval, attempts_left)
    if 0 < approval < 1 and rejected > 1:
        needed = math.ceil(math.log(1 / rejected) / math.log(1 - approval))
    else:
        needed = attempts_left if approval == 0 else 1
    n_rounds = max(0, min(rounds_left, attempts_left, needed))
    cost_rounds = sum(fixed + per_record * rejected * (1 - approval) ** j for j in range(n_rounds))
    cost_in_place = factor * per_record * rejected * e + fixed
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
        "engine_s": round_(busy),
        "per_record_s": per_record,
        "in_place_cost_factor": factor,
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
