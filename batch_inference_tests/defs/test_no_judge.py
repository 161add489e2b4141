"""Issue 40 item 4 on the Dagster path: a judgeless spec materialises as one round whose judge
step approves every inferred record, then the results; the sensor asks for nothing more."""

from __future__ import annotations

import yaml

from batch_inference.defs.driver import drive, start_run
from batch_inference.defs.keys import REJECTED, RESULTS
from batch_inference.defs.runs.jobs import start_run_config
from batch_inference_tests.defs.helpers import check_results, history, latest


def test_a_judgeless_spec_runs_one_round_then_results(defs, instance, write_spec):
    spec_path = write_spec("plain", records=30, approval=0.2, max_rounds=3)
    data = yaml.safe_load(spec_path.read_text())
    del data["judge"]  # a plain classifier: no judge at all
    spec_path.write_text(yaml.safe_dump(data))
    assert start_run(defs, instance, start_run_config(str(spec_path))).success
    result = drive(defs, instance)
    assert history(result) == [("shard_job", "plain"), ("round_job", "plain|r00"), ("results_job", "plain")]
    assert all(r.success for r in result.launched)
    assert latest(instance, REJECTED, "plain|r00")["decision"] == "done"
    res = latest(instance, RESULTS, "plain")
    assert (res["records"], res["approved"], res["exhausted"]) == (30, 30, 0) and res["conservation_ok"] is True
    assert check_results(instance, RESULTS)["conservation"] is True
