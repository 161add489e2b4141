"""Pure pieces: partition keys, the sensor's policy, resources, metadata."""

from __future__ import annotations

import dagster as dg
import pytest

from batch_inference.defs.keys import REJECTED, SHARDED, SOURCE, TAIL_RETRY
from batch_inference.defs.metadata import funnel_markdown, phase_metadata
from batch_inference.defs.partitions import ROUNDS, RoundKey, parse_round_key
from batch_inference.defs.pool.resources import PoolResource
from batch_inference.defs.rounds.sensors import follow_up
from batch_inference.defs.storage.resources import StorageResource
from batch_inference.pipeline import Decision, LedgerView, PhaseSummary, PipelineSpec, RoundView, ShardSummary


def test_round_keys_read_run_then_round():
    key = RoundKey("nightly-20261129", 3)
    assert str(key) == "nightly-20261129|r03"
    assert parse_round_key("nightly-20261129|r03") == key
    assert parse_round_key(key.partition_key()) == key
    assert ROUNDS.get_partition_key_from_str(str(key)).keys_by_dimension == {"pipeline": "nightly-20261129", "round": "r03"}
    for bad in ("nightly", "nightly|3", "|r01", "a|r1"):
        with pytest.raises(ValueError, match="not '<run>\\|rNN'"):
            parse_round_key(bad)


def meta(**values):
    return {k: dg.MetadataValue.text(v) for k, v in values.items()}


@pytest.mark.parametrize(
    ("key", "partition", "metadata", "expected"),
    [
        (SOURCE, "n", {}, ("shard_job", "n", "n:shard", None)),
        (SHARDED, "n", meta(strategy="rounds"), ("round_job", "n|r00", "n|r00", "r00")),
        (SHARDED, "n", meta(strategy="in_place"), ("tail_job", "n", "n:tail", None)),
        (REJECTED, "n|r01", meta(decision="next_round"), ("round_job", "n|r02", "n|r02", "r02")),
        (REJECTED, "n|r01", meta(decision="tail"), ("tail_job", "n", "n:tail", None)),
        (REJECTED, "n|r02", meta(decision="done"), ("results_job", "n", "n:results", None)),
        (REJECTED, "n|r02", meta(decision="exhausted"), ("results_job", "n", "n:results", None)),
        (TAIL_RETRY, "n", {}, ("results_job", "n", "n:results", None)),
    ],
)
def test_one_follow_up_per_step(key, partition, metadata, expected):
    action = follow_up(key, partition, metadata)
    assert (action.job_name, action.partition_key, action.run_key, action.new_round_label) == expected


def test_tail_after_round_n_starts_from_round_n_plus_1():
    action = follow_up(REJECTED, "n|r04", meta(decision="tail", decision_reason="shrank 10%"))
    assert action.run_config == {"ops": {"tail_retry": {"config": {"from_round": 5}}}}
    assert "shrank 10%" in action.run_request().tags["batch_inference/reason"]


def test_a_prefixed_pipelines_tail_config_names_its_own_op():
    """The tail asset's op under a prefix is ``scoring__tail_retry``: a run config naming
    ``tail_retry`` made every prefixed tail job fail with DagsterInvalidConfigError."""
    from batch_inference.defs.jobs import build_jobs
    from batch_inference.defs.keys import PipelineKeys

    k = PipelineKeys(("scoring",))
    action = follow_up(k.rejected, "n|r04", meta(decision="tail"), k, build_jobs(k))
    assert action.run_config == {"ops": {"scoring__tail_retry": {"config": {"from_round": 5}}}}
    in_place = follow_up(k.sharded, "n", {"strategy": dg.MetadataValue.text("in_place")}, k, build_jobs(k))
    assert in_place.job_name == "scoring__tail_job" and in_place.run_config == {"ops": {"scoring__tail_retry": {"config": {"from_round": 0}}}}


def test_unknown_decision_is_loud():
    with pytest.raises(ValueError, match="no known decision"):
        follow_up(REJECTED, "n|r00", {})
    assert follow_up(dg.AssetKey("inferred"), "n|r00", {}) is None


def test_storage_settings_use_dagster_aws_names_and_map_to_s3fs():
    from dagster_aws.s3 import S3Resource

    assert set(StorageResource.model_fields) - {"base_url"} == set(S3Resource.model_fields)
    s3 = S3Resource(region_name="eu-west-1", endpoint_url="http://127.0.0.1:9000", aws_access_key_id="AK",
                    aws_secret_access_key="SK", verify=False, max_attempts=7)
    opts = StorageResource.from_s3_resource(s3, base_url="s3://b/runs").storage_options()
    assert opts == {"key": "AK", "secret": "SK", "endpoint_url": "http://127.0.0.1:9000",
                    "client_kwargs": {"region_name": "eu-west-1", "verify": False},
                    "config_kwargs": {"retries": {"max_attempts": 7}}}
    assert StorageResource().storage_options() == {}


def test_storage_options_reach_a_real_s3_server(s3_server, s3_bucket):
    """The mapped options open the bucket through s3fs, as the storage layer will."""
    import fsspec

    creds = s3_server.storage_options
    storage = StorageResource(endpoint_url=s3_server.endpoint_url, aws_access_key_id=creds["key"],
                              aws_secret_access_key=creds["secret"], region_name="us-east-1")
    fs, path = fsspec.core.url_to_fs(f"{s3_bucket}/probe.txt", **storage.storage_options())
    fs.pipe_file(path, b"ok")
    assert fs.cat_file(path) == b"ok"


def test_pool_resource_points_the_spec_at_its_pool(tmp_path):
    spec = PipelineSpec.parse({
        "run": "x", "input": "in.jsonl", "output": str(tmp_path), "engine": {"kind": "simulated"},
        "infer": {"template": "{p}"}, "judge": {"kind": "rule", "callable": "min_length"},
        "pool": {"launcher": "local", "concurrency": 8},
    })
    assert PoolResource().apply(spec) is spec  # mode "spec": the run's own pool section
    inproc = PoolResource(mode="inprocess", concurrency=2).apply(spec).pool
    assert (inproc.launcher, inproc.concurrency, inproc.endpoints) == ("inprocess", 2, [])
    remote = PoolResource(mode="endpoints", endpoints=["http://10.0.0.5:8700"], token_env="TOK").apply(spec).pool
    assert (remote.endpoints, remote.token_env, remote.concurrency) == (["http://10.0.0.5:8700"], "TOK", 8)
    with pytest.raises(ValueError, match="needs at least one endpoint"):
        PoolResource(mode="endpoints").apply(spec)


def test_phase_metadata_and_funnel():
    summary = {"round": 0, "phase": "judge", "input_url": "/r/in", "output_url": "s3://b/r/out", "shards": 2, "shards_run": 2,
               "records_in": 10, "counts": {"approved": 6, "rejected": 4}, "tokens_in": 100, "tokens_out": 50,
               "engine_busy_s": 1.0, "wall_s": 2.0, "drain_s": 0.5, "avg_fill": 0.8, "cached_tasks": 0, "quarantined": []}
    judge = PhaseSummary.from_dict(summary)
    m = {k: v.value for k, v in phase_metadata(judge).items()}
    assert (m["approval_rate"], m["utilization"], m["records_per_s"]) == (0.6, 0.5, 5.0)
    assert m["output"] == "s3://b/r/out" and m["input"] == "/r/in"
    # a quarantined infer shard: the round's "in" counts it (CLI and Dagster alike), approval = approved / in
    infer = PhaseSummary.from_dict({**summary, "phase": "infer", "counts": {"ok": 10},
                                    "quarantined": [{"shard": "/r/in/part-1", "phase": "infer", "error": "x", "records": 2}]})
    shard = ShardSummary("/in", "/r/in", 12, 2, 12, 0, [], 0.1)
    rnd = RoundView(0, infer=infer, judge=judge, decision=Decision(0, "next_round", "4 rejected", {}))
    view = LedgerView(spec=None, shard=shard, rounds=[rnd])
    table = funnel_markdown(view)
    assert "| round 00 -> next_round | 12 | 6 | 4 | 2 | 50.0% | 200/100 | 4.00 |" in table
    assert {k: v.value for k, v in phase_metadata(rnd).items()}["approval_rate"] == rnd.approval == 0.5
    from batch_inference.pipeline.report import ledger_table, output_console

    console = output_console()
    with console.capture() as captured:
        console.print(ledger_table(view, "t"))
    assert any("round 0" in line and " 12 " in line and " 2 " in line and "50%" in line for line in captured.get().splitlines())


def test_cache_metadata_says_what_the_engine_did_not_compute():
    """Duplicates saved always; the prefix cache's hit rate, prefill and its ideal where the engine keeps one."""
    base = {"round": 0, "input_url": "/r/in", "output_url": "/r/out", "shards": 1, "shards_run": 1, "records_in": 40,
            "tokens_in": 1000, "tokens_out": 80, "engine_busy_s": 0.0, "wall_s": 1.0, "drain_s": 0.0, "avg_fill": 0.0,
            "cached_tasks": 0}
    infer = PhaseSummary.from_dict({**base, "phase": "infer", "counts": {"ok": 40}, "duplicates": 4, "duplicate_tokens_in": 100,
                                    "duplicate_tokens_out": 8, "prefix_queried": 900, "prefix_hits": 600,
                                    "ideal_prefill_tokens": 250})
    judge = PhaseSummary.from_dict({**base, "phase": "judge", "counts": {"approved": 40}, "prefix_queried": 100, "prefix_hits": 0,
                                    "ideal_prefill_tokens": 100})
    m = {k: v.value for k, v in phase_metadata(infer).items()}
    assert (m["duplicates"], m["duplicate_tokens_in"], m["duplicate_tokens_out"]) == (4, 100, 8)
    assert (m["prefix_cache_hit_rate"], m["prefill_tokens"], m["ideal_prefill_tokens"], m["prefill_vs_ideal"]) == (
        0.6667, 300, 250, 1.2) == (infer.prefix_hit_rate, infer.prefill_tokens, infer.ideal_prefill_tokens, infer.prefill_vs_ideal)
    rnd = {k: v.value for k, v in phase_metadata(RoundView(0, infer=infer, judge=judge)).items()}
    assert (rnd["prefix_cache_hit_rate"], rnd["prefill_tokens"], rnd["ideal_prefill_tokens"], rnd["prefill_vs_ideal"]) == (
        0.6, 400, 350, 1.1429)
    plain = {k: v.value for k, v in phase_metadata(PhaseSummary.from_dict({**base, "phase": "infer", "counts": {}})).items()}
    assert plain["duplicates"] == 0 and "prefix_cache_hit_rate" not in plain and "prefill_vs_ideal" not in plain


def test_round_metadata_counts_permanent_errors_as_failed_and_the_review_outcome():
    """The funnel and a round's figures: a judge's permanent errors are failed, not rejected;
    a closed review's verdicts count in approved / rejected."""
    from batch_inference.pipeline.summaries import ReviewSummary

    base = {"round": 0, "input_url": "/r/in", "output_url": "/r/out", "shards": 1, "shards_run": 1, "records_in": 40,
            "tokens_in": 0, "tokens_out": 0, "engine_busy_s": 0.0, "wall_s": 1.0, "drain_s": 0.0, "avg_fill": 0.0,
            "cached_tasks": 0}
    infer = PhaseSummary.from_dict({**base, "phase": "infer", "counts": {"ok": 38, "error": 2}})
    judge = PhaseSummary.from_dict({**base, "phase": "judge", "counts": {"approved": 20, "rejected": 5, "permanent_errors": 2,
                                                                        "review": 15}})
    review = ReviewSummary(0, 15, 9, 6, {"kim": 15}, {"approve": 9, "reject": 6}, 0, 0, [], 1, 0.0, 0.1)
    rnd = RoundView(0, infer=infer, judge=judge, decision=Decision(0, "next_round", "9 rejected", {}), review=review)
    assert (rnd.approved, rnd.rejected, rnd.failed, rnd.awaiting_review, rnd.approval) == (29, 9, 2, 0, 0.725)
    m = {k: v.value for k, v in phase_metadata(rnd).items()}
    assert (m["approved"], m["rejected"], m["failed_records"], m["approval_rate"]) == (29, 9, 2, 0.725)
    view = LedgerView(spec=None, shard=None, rounds=[rnd])
    assert "| round 00 -> next_round | 40 | 29 | 9 | 2 | 72.5% |" in funnel_markdown(view)
    waiting = RoundView(0, infer=infer, judge=judge)
    assert (waiting.approved, waiting.rejected, waiting.awaiting_review) == (20, 3, 15)


def test_the_tail_row_counts_errors_as_failed_in_the_funnel_and_the_cli_alike():
    """The in-place tail's errors ended failed and its max_attempts rows are unfinished: the
    Dagster funnel says so as the CLI table does."""
    from batch_inference.pipeline.report import ledger_table, output_console

    tail = PhaseSummary.from_dict({
        "round": 1, "phase": "tail", "input_url": "/r/p", "output_url": "/r/t", "shards": 1, "shards_run": 1, "records_in": 10,
        "counts": {"approved": 5, "max_attempts": 2, "error": 3}, "tokens_in": 0, "tokens_out": 0, "engine_busy_s": 0.0,
        "wall_s": 1.0, "drain_s": 0.0, "avg_fill": 0.0, "cached_tasks": 0,
    })
    view = LedgerView(spec=None, shard=None, tail=tail)
    assert "| tail (in place) | 10 | 5 | 2 (max attempts) | 3 | 50.0% |" in funnel_markdown(view)
    console = output_console()
    with console.capture() as captured:
        console.print(ledger_table(view, "t"))
    row = next(line for line in captured.get().splitlines() if "tail (from 1)" in line)
    assert [c.strip() for c in row.split("│")][2:6] == ["10", "5", "2*", "3"], row


def test_a_backlog_larger_than_a_tick_is_handled_oldest_first(monkeypatch):
    """With more events than one tick takes, the cursor stops at the last one handled."""
    from batch_inference.defs.partitions import RUNS
    from batch_inference.defs.rounds import sensors
    from batch_inference.defs.rounds.sensors import _records_since

    monkeypatch.setattr(sensors, "MAX_EVENTS_PER_TICK", 3)
    monkeypatch.setattr(sensors, "PAGE", 2)
    instance = dg.DagsterInstance.ephemeral()
    runs = [f"r{i}" for i in range(5)]
    instance.add_dynamic_partitions(RUNS.name, runs)
    for i, run in enumerate(runs):  # interleave two watched keys
        key = SOURCE if i % 2 == 0 else SHARDED
        instance.report_runless_asset_event(dg.AssetMaterialization(key, partition=run))
    first = _records_since(instance, 0)
    assert [r.partition_key for r in first] == ["r0", "r1", "r2"]
    rest = _records_since(instance, first[-1].storage_id)
    assert [r.partition_key for r in rest] == ["r3", "r4"]


def test_a_malformed_event_is_skipped_not_wedging_the_sensor():
    from batch_inference.defs.driver import tick
    from batch_inference.defs.partitions import ROUND_NUMBERS, RUNS
    from batch_inference.definitions import build_definitions

    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(RUNS.name, ["a", "b"])
    instance.add_dynamic_partitions(ROUND_NUMBERS.name, ["r00"])
    instance.report_runless_asset_event(dg.AssetMaterialization(REJECTED, partition="a|r00"))  # no decision
    instance.report_runless_asset_event(dg.AssetMaterialization(SOURCE, partition="b"))
    data = tick(build_definitions(), instance, None)
    assert [r.run_key for r in data.run_requests] == ["b:shard"]
    assert int(data.cursor) > 0


def _materialized_by_run(instance: dg.DagsterInstance, key: dg.AssetKey, partition: str, run_id: str) -> None:
    """A materialisation recorded as produced by the Dagster run ``run_id``."""
    from dagster._core.events import DagsterEvent, DagsterEventType, StepMaterializationData

    event = DagsterEvent(event_type_value=DagsterEventType.ASSET_MATERIALIZATION.value, job_name="round_job",
                         event_specific_data=StepMaterializationData(dg.AssetMaterialization(key, partition=partition)))
    instance.report_dagster_event(event, run_id=run_id)


def test_a_running_step_of_one_pipeline_does_not_stall_another():
    """Pipeline a's sharded event comes from a run still going; b's next step is requested
    anyway, a's once its run succeeds, and no event is handled twice over the ticks."""
    from types import SimpleNamespace

    from batch_inference.defs.driver import tick
    from batch_inference.defs.partitions import ROUND_NUMBERS, RUNS
    from batch_inference.definitions import build_definitions

    defs = build_definitions()
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(RUNS.name, ["a", "b"])
    runs = {"run-a": SimpleNamespace(is_finished=False, status=dg.DagsterRunStatus.STARTED),
            "run-b": SimpleNamespace(is_finished=True, status=dg.DagsterRunStatus.SUCCESS)}
    instance.get_run_by_id = runs.get  # type: ignore[method-assign]
    _materialized_by_run(instance, SHARDED, "a", "run-a")
    _materialized_by_run(instance, SHARDED, "b", "run-b")

    first = tick(defs, instance, None)
    assert [r.run_key for r in first.run_requests] == ["b|r00"]
    second = tick(defs, instance, first.cursor)  # a still running: nothing new, b not re-handled
    assert second.run_requests == []
    runs["run-a"] = SimpleNamespace(is_finished=True, status=dg.DagsterRunStatus.SUCCESS)
    third = tick(defs, instance, second.cursor)
    assert [r.run_key for r in third.run_requests] == ["a|r00"]
    assert tick(defs, instance, third.cursor).run_requests == []
    assert instance.get_dynamic_partitions(ROUND_NUMBERS.name) == ["r00"]
    assert third.cursor.isdigit()  # everything handled: back to a plain storage id


def test_sensor_cursor_keeps_handled_ids_above_the_first_waiting_event():
    from batch_inference.defs.rounds.sensors import SensorCursor

    cursor = SensorCursor(after=4)
    cursor.handled |= {5, 7}
    cursor.advance([5, 6, 7], complete=True)  # 6 waits
    assert (cursor.after, cursor.handled) == (5, {7})
    again = SensorCursor.parse(str(cursor))
    assert (again.after, again.handled) == (5, {7})
    again.handled.add(6)
    partial = SensorCursor(again.after, set(again.handled))
    partial.advance([6], complete=False)  # a full window ending at 6: 7 is past what was read
    assert (partial.after, partial.handled) == (6, {7})
    again.advance([6], complete=True)  # 7 was skipped this tick as already handled
    assert str(again) == "7" and again.handled == set()


def test_the_code_location_is_every_domains_definitions_merged():
    """What the domains' Definitions add up to: a definition dropped from a domain, or listed
    in two, changes this inventory."""
    from batch_inference.definitions import build_definitions

    defs = build_definitions()
    dg.Definitions.validate_loadable(defs)
    repo = defs.get_repository_def()
    assert sorted(k.to_user_string() for k in defs.resolve_all_asset_keys()) == [
        "approved", "failed", "inferred", "openai_batch_export", "parquet_export", "pending", "rejected", "results", "reviewed",
        "sharded", "source_dataset", "tail_retry"]
    assert sorted((k.asset_key.to_user_string(), k.name) for k in defs.resolve_asset_graph().asset_check_keys) == [
        ("failed", "quarantine_empty"), ("rejected", "review_age"), ("rejected", "round_conservation"),
        ("results", "approval_floor"), ("results", "conservation"), ("results", "no_duplicate_ids"),
        ("results", "run_quarantine_empty"), ("results", "structured_output_valid")]
    assert sorted(j.name for j in repo.get_all_jobs() if not j.name.startswith("__")) == [
        "results_job", "review_job", "round_job", "shard_job", "start_pipeline_run", "tail_job"]
    assert [s.name for s in repo.sensor_defs] == ["round_sensor"]
    assert [s.name for s in repo.schedule_defs] == ["nightly_pipeline"]
    assert sorted(defs.resources or {}) == ["batch_inference_results", "judge_pool", "pool", "storage"]


def test_resources_and_the_schedule_read_the_environment():
    from batch_inference.defs.pool.definitions import pool_from_env
    from batch_inference.defs.runs.definitions import build_definitions as runs_definitions
    from batch_inference.defs.storage.definitions import storage_from_env

    pool = pool_from_env({"BATCH_INFERENCE_POOL_MODE": "endpoints", "BATCH_INFERENCE_POOL_ENDPOINTS": " http://a:1, ,http://b:2",
                          "BATCH_INFERENCE_POOL_TOKEN_ENV": "TOK"})
    assert (pool.mode, pool.endpoints, pool.token_env) == ("endpoints", ["http://a:1", "http://b:2"], "TOK")
    assert (pool_from_env({}).mode, pool_from_env({}).token_env) == ("spec", None)
    judge = pool_from_env({"BATCH_INFERENCE_POOL_MODE": "inprocess", "BATCH_INFERENCE_JUDGE_POOL_MODE": "endpoints",
                           "BATCH_INFERENCE_JUDGE_POOL_ENDPOINTS": "http://j:1"}, role="judge")
    assert (judge.role, judge.mode, judge.endpoints) == ("judge", "endpoints", ["http://j:1"])
    storage = storage_from_env({"BATCH_INFERENCE_BASE_URL": "s3://b/runs", "AWS_REGION": "eu-west-1"})
    assert (storage.base_url, storage.region_name, storage.endpoint_url) == ("s3://b/runs", "eu-west-1", None)
    (schedule,) = runs_definitions(env={"BATCH_INFERENCE_SCHEDULE_SPEC": "/specs/n.yaml",
                                        "BATCH_INFERENCE_SCHEDULE_CRON": "30 1 * * *"}).schedules or []
    assert schedule.cron_schedule == "30 1 * * *" and "/specs/n.yaml" in (schedule.description or "")
