"""``Counts``: the one value type the pipeline sums outcome counts with."""

from __future__ import annotations

import orjson

from batch_inference.pipeline.counts import Counts
from batch_inference.pipeline.summaries import LedgerView, StepProgress, add_counts


def test_plus_sums_key_by_key_and_keeps_zeros() -> None:
    a = Counts({"approved": 2, "rejected": 0})
    total = a + {"approved": "3", "error": 1}  # a task's JSON counts, as they come
    assert total == {"approved": 5, "rejected": 0, "error": 1}
    assert a == {"approved": 2, "rejected": 0}  # a value: the operands stay as they were
    assert sum([Counts({"ok": 1}), Counts({"ok": 2, "error": 1})]) == {"ok": 3, "error": 1}
    assert Counts.total([]) == {} and Counts.total([{"ok": 1}, {"ok": 1}])["ok"] == 2
    assert orjson.loads(orjson.dumps(total.as_dict())) == dict(total)


def test_add_counts_and_the_settled_tail_sum_through_it() -> None:
    assert add_counts(({"approved": 1}, {"approved": 2, "error": 1})) == {"approved": 3, "error": 1}
    tail = StepProgress(step="tail", shards_done=1, shards_running=1, records_done=3, records_running=2,
                        done={"approved": 2, "error": 1}, running={"approved": 2}, committed={"approved": 1, "max_attempts": 1})
    view = LedgerView(spec=None, shard=None, steps={"tail": tail})
    assert view.settled() == {"approved": 3, "failed": 2}
