"""The hybrid: rounds while they pay, then in-place retry; the decision and its figures are recorded."""

from __future__ import annotations

from pathlib import Path

import orjson

from batch_inference.pipeline import CrossoverRule, PipelineRun, choose_crossover, run_pipeline
from batch_inference.pipeline.policy import expected_attempts
from batch_inference_tests.pipeline.helpers import CountingRunner


def ledger(spec, name: str) -> dict:
    return orjson.loads((Path(spec.output) / spec.run / "ledger" / f"{name}.json").read_bytes())


def test_expected_attempts() -> None:
    assert expected_attempts(1.0, 5) == 1.0
    assert expected_attempts(0.0, 4) == 4.0
    assert abs(expected_attempts(0.5, 3) - 1.75) < 1e-9
    assert expected_attempts(0.5, 0) == 0.0


def test_rule_switches_on_shrink_and_on_cost() -> None:
    # a round of 1,000 records: wall 10 s, engine busy 9 s -> fixed 1 s a round, 9 ms per record
    common = dict(round=0, records_in=1000, wall_s=10.0, engine_s=9.0, rounds_left=4, attempts_left=4)
    # pending shrank 20% < 50%: switch
    switch, reason, figures = choose_crossover(CrossoverRule(min_shrink=0.5, compare_cost=False), approved=200, rejected=800, **common)
    assert switch and "shrank 20.0%" in reason and figures["shrink"] == 0.2
    # shrank 90%, cost comparison off: keep going, and the reason names the rule that decided
    # (not "rounds <= in-place": with this overhead in-place is projected cheaper)
    switch, reason, figures = choose_crossover(CrossoverRule(min_shrink=0.5, compare_cost=False), approved=900, rejected=100,
                                               overhead_s=0.6, recompact_s=0.2, **common)
    assert not switch and figures["projected_rounds_s"] > figures["projected_in_place_s"]
    assert "shrank 90.0% >= 50%" in reason and "cost comparison off" in reason and "<=" not in reason
    # shrank 90%; the fixed second is all latency chain (in-place pays it too): rounds go on
    switch, _, figures = choose_crossover(CrossoverRule(), approved=900, rejected=100, **common)
    assert not switch and figures["rounds_projected"] == 2 and figures["avoidable_s"] == 0
    # ... but when most of it is per-round overhead (dispatch gaps, recompaction), hand over
    switch, reason, figures = choose_crossover(CrossoverRule(), approved=900, rejected=100, overhead_s=0.6, recompact_s=0.2, **common)
    assert switch and figures["projected_rounds_s"] > figures["projected_in_place_s"] and "projected rounds" in reason
    # low approval, where an in-place record-attempt costs more than a round's (f = 1.7):
    # the per-record work dominates and rounds go on
    dear = CrossoverRule(in_place_cost_factor=1.7)
    switch, _, figures = choose_crossover(dear, approved=200, rejected=800, overhead_s=1.0, **common)
    assert not switch and figures["rounds_projected"] == 4
    # ... unless the rounds carry a large measured overhead (a scheduler, slow storage)
    slow = {**common, "engine_s": 5.0}
    assert choose_crossover(dear, approved=200, rejected=800, overhead_s=4.0, **slow)[0]
    assert not choose_crossover(dear, approved=200, rejected=800, **slow)[0]
    # with in-place's record-attempt about a round's (the default), the same overhead hands over
    assert choose_crossover(CrossoverRule(), approved=200, rejected=800, overhead_s=1.0, **common)[0]
    # a factor calibrated for a cheaper in-place loop hands over even without measured overhead
    assert choose_crossover(CrossoverRule(in_place_cost_factor=0.8), approved=200, rejected=800, **common)[0]
    # min_rounds holds the rule back
    switch, reason, _ = choose_crossover(CrossoverRule(min_shrink=0.5, min_rounds=2), approved=200, rejected=800, **common)
    assert not switch and "at least 2" in reason


async def test_hybrid_switches_when_the_pending_set_stops_shrinking(make_spec) -> None:
    spec = make_spec(strategy="hybrid", approval=0.25, max_rounds=5, max_attempts=5,
                     crossover={"min_shrink": 0.5, "compare_cost": False})
    summary = await run_pipeline(spec)
    decision = ledger(spec, "round-00-decision")
    assert decision["kind"] == "tail" and "shrank" in decision["reason"]
    assert decision["figures"]["approval"] < 0.5 and "projected_rounds_s" in decision["figures"]
    assert summary.rounds == 1 and summary.tail
    tail = ledger(spec, "tail")
    assert tail["from_round"] == 1 and tail["records_in"] == decision["figures"]["rejected"]
    assert summary.conservation["ok"] and summary.approved + summary.max_attempts == 600
    # attempts count across the round and the tail: nobody exceeds max_attempts
    rows = [r for d in ("results", "tail/unfinished") for r in _rows(spec, d)]
    assert max(r["attempts"] for r in rows) == 5
    assert all(r["attempts"] >= 2 for r in _rows(spec, "tail/unfinished"))


async def test_hybrid_keeps_rounds_while_they_pay(make_spec) -> None:
    spec = make_spec(strategy="hybrid", approval=0.8, max_rounds=6, max_attempts=6,
                     crossover={"min_shrink": 0.5, "compare_cost": False})
    summary = await run_pipeline(spec)
    assert ledger(spec, "round-00-decision")["kind"] == "next_round"
    assert summary.rounds >= 2 and not summary.tail
    assert summary.status == "converged" and summary.conservation["ok"]


async def test_hybrid_hands_over_at_max_rounds_instead_of_exhausting(make_spec) -> None:
    spec = make_spec(strategy="hybrid", approval=0.6, max_rounds=1, max_attempts=4,
                     crossover={"min_shrink": 0.0, "compare_cost": False})
    summary = await run_pipeline(spec)
    decision = ledger(spec, "round-00-decision")
    assert decision["kind"] == "tail" and "max_rounds" in decision["reason"]
    assert summary.tail and summary.exhausted == 0 and summary.conservation["ok"]


async def test_decide_is_recorded_once(make_spec) -> None:
    spec = make_spec(strategy="hybrid", approval=0.5)
    from batch_inference.pipeline.runner import open_runner

    async with open_runner(spec) as runner:
        run = PipelineRun(spec, runner)
        await run.shard()
        await run.infer(0)
        await run.judge(0)
    first = run.decide(0)
    assert PipelineRun(spec).decide(0) == first  # a re-run reads the recorded decision


def _rows(spec, d: str) -> list[dict]:
    from batch_inference.storage import JsonlDir

    path = Path(spec.output) / spec.run / d
    return list(JsonlDir(str(path)).iter_records_sync()) if path.exists() else []


class _TwoWorkers(CountingRunner):
    """A runner whose tasks come back from two workers (as from two ``endpoints``), each task
    having kept its engine busy 0.5 ms."""

    async def run_task(self, spec):
        result = await super().run_task(spec)
        self.calls["returned"] += 1
        return result.model_copy(update={"worker": f"w{self.calls['returned'] % 2}", "engine_busy_s": 0.0005})


async def test_crossover_divides_engine_time_by_the_workers_that_ran_the_round(make_spec) -> None:
    """pool.replicas says 3, but two workers (endpoints) ran the round: engine s / 2."""
    from batch_inference.pipeline.runner import open_runner
    from batch_inference.pipeline.summaries import PhaseSummary

    spec = make_spec(strategy="hybrid", approval=0.5, pool={"replicas": 3})
    async with open_runner(spec) as pool:
        run = PipelineRun(spec, _TwoWorkers(pool))
        await run.shard()
        infer, judge = await run.infer(0), await run.judge(0)
    assert infer.workers == judge.workers == 2
    assert PhaseSummary.from_dict(ledger(spec, "round-00-infer")).workers == 2
    assert (infer.engine_busy_s, judge.engine_busy_s) == (0.003, 0.003)  # 6 shards' tasks, 0.5 ms each
    assert run.decide(0).figures["engine_s"] == 0.003  # (3 + 3 ms) / 2 workers; / 3 replicas would be 0.002


def reads_true(reason: str) -> bool:
    """The reason's cost comparison holds for the figures it prints."""
    import re

    m = re.search(r"projected rounds ([\d.]+)s ([<>=]) in-place ([\d.]+)s", reason)
    assert m, reason
    a, op, b = float(m[1]), m[2], float(m[3])
    return {"<": a < b, ">": a > b, "=": a == b}[op]


def test_the_crossover_reason_prints_figures_that_bear_it_out() -> None:
    """Costs 2.990 s by rounds and 2.987 s in place hand over; the reason read
    "projected rounds 2.99s > in-place 2.99s", a contradiction (issue 28 item 6)."""
    common = dict(round=0, records_in=1000, wall_s=10.0, engine_s=9.0, rounds_left=4, attempts_left=4, approved=900, rejected=100)
    switch, reason, _ = choose_crossover(CrossoverRule(), overhead_s=0.0129, **common)
    assert switch and reads_true(reason), reason
    assert reason == "projected rounds 2.990s > in-place 2.987s"
    # rounds a hair cheaper: they go on, and the figures say so
    switch, reason, _ = choose_crossover(CrossoverRule(), overhead_s=0.0095, **common)
    assert not switch and reads_true(reason), reason
    # figures that agree to the microsecond are called equal (a tie keeps the rounds)
    from batch_inference.pipeline.policy import versus

    assert versus(1.85, 1.85) == "projected rounds 1.85s = in-place 1.85s (equal to the microsecond: a tie keeps the rounds)"
    assert reads_true(versus(0.914, 0.906)) and versus(0.914, 0.906) == "projected rounds 0.914s > in-place 0.906s"
