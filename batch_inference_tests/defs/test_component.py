"""``BatchInferenceComponent`` in a user's project: scaffolded, loaded, prefixed, driven end to end.

A sandboxed ``dg`` defs folder (Dagster's own ``create_defs_folder_sandbox``) holds the
component's ``defs.yaml`` beside the user's upstream asset (it writes the prompts and names
the file in its metadata) and a downstream asset that reads the results through the IO
manager. The pipeline is driven by ticking its real round sensor (``defs.driver``).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import dagster as dg
import yaml
from dagster.components.testing import create_defs_folder_sandbox

from batch_inference import BatchInferenceComponent
from batch_inference.defs.driver import drive
from batch_inference.defs.runs.start import SpecSource
from batch_inference_tests.defs.helpers import simulated_spec, write_input

PIPELINE_ASSETS = ["approved", "failed", "inferred", "openai_batch_export", "parquet_export", "pending", "rejected", "results",
                   "reviewed", "sharded", "source_dataset", "tail_retry"]


def _spec(tmp_path: Path) -> dict:
    spec = simulated_spec("unused", tmp_path / "none.jsonl", tmp_path / "out", approval=0.6)
    del spec["run"], spec["input"]  # the run is the partition; the input comes from the upstream
    return spec


def test_scaffold_writes_a_defs_yaml_that_loads() -> None:
    with create_defs_folder_sandbox() as sandbox:
        path = sandbox.scaffold_component(component_cls=BatchInferenceComponent, defs_path="scoring")
        body = yaml.safe_load((path / "defs.yaml").read_text())
        assert body["type"] == "batch_inference.components.batch_inference_component.BatchInferenceComponent" or \
            body["type"].endswith("BatchInferenceComponent")
        assert body["attributes"]["schedule"] == {"cron": "0 2 * * *", "run_name": "scoring-{date}"}
        # the scaffolded spec is a valid spec (its input is the user's to write): a run of it would start,
        # writing where the run's start puts it (no output: the instance's storage, test_component_output.py)
        assert "output" not in body["attributes"]["spec"]
        spec = SpecSource(inline=body["attributes"]["spec"], base_dir=str(path)).load(run="scoring-1", output="/runs")
        assert spec.input == str(path / "prompts.jsonl") and spec.engine.kind == "simulated"
        with sandbox.build_all_defs() as defs:
            dg.Definitions.validate_loadable(defs)
            keys = sorted(k.to_user_string() for k in defs.resolve_all_asset_keys())
            assert keys == [f"scoring/{name}" for name in PIPELINE_ASSETS]
            repo = defs.get_repository_def()
            assert {s.name for s in repo.schedule_defs} == {"scoring__schedule"}
            assert "scoring__round_sensor" in {s.name for s in repo.sensor_defs}


def test_two_pipelines_in_one_project_upstream_to_downstream(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    write_input(prompts, 40)
    with create_defs_folder_sandbox() as sandbox:
        for name in ("scoring", "ranking"):
            sandbox.scaffold_component(component_cls=BatchInferenceComponent, defs_path=name, defs_yaml_contents={
                "type": "batch_inference.BatchInferenceComponent",
                "attributes": {"spec": _spec(tmp_path), "deps": ["raw_prompts"], "approval_floor": 0.1,
                               "schedule": {"cron": "0 3 * * *", "run_name": f"{name}-{{date}}"}},
            })
        (sandbox.defs_folder_path / "user_assets.py").write_text(textwrap.dedent(f'''
            from collections.abc import Iterator
            import dagster as dg

            @dg.asset
            def raw_prompts() -> dg.MaterializeResult:
                return dg.MaterializeResult(metadata={{"path": dg.MetadataValue.path({str(prompts)!r})}})

            @dg.asset(ins={{"results": dg.AssetIn(key=["scoring", "results"], partition_mapping=dg.LastPartitionMapping())}},
                      automation_condition=dg.AutomationCondition.eager())
            def scored_rows(results: Iterator) -> dg.MaterializeResult:
                rows = list(results)
                return dg.MaterializeResult(metadata={{"rows": len(rows), "first_id": str(rows[0]["id"]) if rows else ""}})
        '''))
        with sandbox.build_all_defs() as defs:
            dg.Definitions.validate_loadable(defs)
            graph = defs.resolve_asset_graph()
            keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
            assert {f"{p}/{n}" for p in ("scoring", "ranking") for n in PIPELINE_ASSETS} | {"raw_prompts", "scored_rows"} == keys
            # lineage: the user's upstream -> this pipeline -> the user's downstream
            assert dg.AssetKey("raw_prompts") in graph.get(dg.AssetKey(["scoring", "source_dataset"])).parent_keys
            assert dg.AssetKey(["scoring", "results"]) in graph.get(dg.AssetKey("scored_rows")).parent_keys
            checks = {(c.asset_key.to_user_string(), c.name) for c in graph.asset_check_keys}
            assert {("scoring/results", "conservation"), ("scoring/results", "approval_floor"),
                    ("scoring/rejected", "round_conservation")} <= checks
            repo = defs.get_repository_def()
            assert {"scoring__round_sensor", "ranking__round_sensor", "scoring__downstream_automation"} <= {s.name for s in repo.sensor_defs}

            instance = dg.DagsterInstance.ephemeral()
            assert dg.materialize([defs.get_assets_def("raw_prompts")], instance=instance).success
            result = drive(defs, instance, sensor_name="scoring__round_sensor", log_level="WARNING")
            jobs = [r.job_name for r in result.launched]
            assert jobs[0] == "scoring__start_pipeline_run" and jobs[-1] == "scoring__results_job", jobs
            assert all(r.success for r in result.launched), [r for r in result.launched if not r.success]
            runs = instance.get_dynamic_partitions("scoring__pipeline_runs")
            assert len(runs) == 1 and runs[0].startswith("scoring-")
            results = instance.get_latest_materialization_event(dg.AssetKey(["scoring", "results"]))
            meta = results.asset_materialization.metadata
            assert meta["records"].value == 40 and results.asset_materialization.partition == runs[0]
            # each check's result is on the run's partition
            evaluation = instance.event_log_storage.get_latest_asset_check_execution_by_key(
                [dg.AssetCheckKey(dg.AssetKey(["scoring", "results"]), "conservation")])
            assert evaluation  # recorded
            # the other pipeline is untouched by scoring's events
            assert instance.get_dynamic_partitions("ranking__pipeline_runs") == []

            downstream = dg.materialize([defs.get_assets_def("scored_rows"), defs.get_assets_def(["scoring", "results"])],
                                        selection=["scored_rows"], instance=instance,
                                        resources=dict(defs.resources or {}))
            assert downstream.success
            got = instance.get_latest_materialization_event(dg.AssetKey("scored_rows")).asset_materialization.metadata
            assert got["rows"].value == meta["approved"].value > 0


def test_structured_output_check_validates_each_result_against_its_format(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from batch_inference.defs.runs.checks import structured_output_errors

    results = tmp_path / "results"
    results.mkdir()
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": ["x"]}}}
    rows = [{"id": "a", "result": '{"x": 1}', "response_format": schema},
            {"id": "b", "result": '{"y": 1}', "response_format": schema},
            {"id": "c", "result": "not json", "body": {"response_format": {"type": "json_object"}}},
            {"id": "d", "result": "free text"}]
    (results / "round-00-part-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = SimpleNamespace(infer=SimpleNamespace(response_format=None), storage_options={})
    checked, invalid = structured_output_errors(spec, str(results))
    assert checked == 3
    assert [e["id"] for e in invalid] == ["b", "c"]
    assert "required" in invalid[0]["error"] and "not strict JSON" in invalid[1]["error"]


def test_the_first_tick_starts_one_run_over_the_upstreams_newest_materialisation_not_its_history(tmp_path: Path) -> None:
    # a component added to a project whose upstream was materialised three times before: one run, over the newest
    prompts = [tmp_path / f"prompts-{i}.jsonl" for i in range(3)]
    for path in prompts:
        write_input(path, 5)
    with create_defs_folder_sandbox() as sandbox:
        sandbox.scaffold_component(component_cls=BatchInferenceComponent, defs_path="scoring", defs_yaml_contents={
            "type": "batch_inference.BatchInferenceComponent",
            "attributes": {"spec": _spec(tmp_path), "deps": ["raw_prompts"]},
        })
        (sandbox.defs_folder_path / "user_assets.py").write_text(textwrap.dedent('''
            import dagster as dg

            @dg.asset(config_schema={"path": str})
            def raw_prompts(context) -> dg.MaterializeResult:
                return dg.MaterializeResult(metadata={"path": dg.MetadataValue.path(context.op_config["path"])})
        '''))
        with sandbox.build_all_defs() as defs:
            instance = dg.DagsterInstance.ephemeral()
            for path in prompts:
                assert dg.materialize([defs.get_assets_def("raw_prompts")], instance=instance,
                                      run_config={"ops": {"raw_prompts": {"config": {"path": str(path)}}}}).success
            sensor = defs.get_sensor_def("scoring__round_sensor")
            with dg.build_sensor_context(instance=instance, definitions=defs, sensor_name="scoring__round_sensor", resources=dict(defs.resources or {})) as context:
                first = sensor.evaluate_tick(context)
            starts = [r for r in first.run_requests or [] if r.job_name == "scoring__start_pipeline_run"]
            assert len(starts) == 1, starts
            assert str(prompts[-1]) in json.dumps(starts[0].run_config)
            # the next tick (its cursor kept) starts nothing more; a new materialisation starts one more
            with dg.build_sensor_context(instance=instance, definitions=defs, sensor_name="scoring__round_sensor", cursor=first.cursor,
                                         resources=dict(defs.resources or {})) as context:
                again = sensor.evaluate_tick(context)
            assert not [r for r in again.run_requests or [] if r.job_name == "scoring__start_pipeline_run"]
            assert dg.materialize([defs.get_assets_def("raw_prompts")], instance=instance,
                                  run_config={"ops": {"raw_prompts": {"config": {"path": str(prompts[0])}}}}).success
            with dg.build_sensor_context(instance=instance, definitions=defs, sensor_name="scoring__round_sensor", cursor=again.cursor,
                                         resources=dict(defs.resources or {})) as context:
                third = sensor.evaluate_tick(context)
            assert len([r for r in third.run_requests or [] if r.job_name == "scoring__start_pipeline_run"]) == 1


def test_the_next_nights_run_hits_the_result_cache_for_every_unchanged_record(tmp_path: Path) -> None:
    # night 1 over 40 records; night 2's upstream writes the same 40 plus 4 new: only the new ones are computed
    night1, night2 = tmp_path / "night-1.jsonl", tmp_path / "night-2.jsonl"
    write_input(night1, 40)
    write_input(night2, 40)
    with night2.open("ab") as f:
        for i in range(4):
            f.write(json.dumps({"id": f"new{i}", "prompt": f"something new {i}"}).encode() + b"\n")
    with create_defs_folder_sandbox() as sandbox:
        sandbox.scaffold_component(component_cls=BatchInferenceComponent, defs_path="scoring", defs_yaml_contents={
            "type": "batch_inference.BatchInferenceComponent",
            "attributes": {"spec": _spec(tmp_path), "deps": ["raw_prompts"]},
        })
        (sandbox.defs_folder_path / "user_assets.py").write_text(textwrap.dedent('''
            import dagster as dg

            @dg.asset(config_schema={"path": str})
            def raw_prompts(context) -> dg.MaterializeResult:
                return dg.MaterializeResult(metadata={"path": dg.MetadataValue.path(context.op_config["path"])})
        '''))
        with sandbox.build_all_defs() as defs:
            instance = dg.DagsterInstance.ephemeral()
            cursor = None
            nights = []
            for path in (night1, night2):
                assert dg.materialize([defs.get_assets_def("raw_prompts")], instance=instance,
                                      run_config={"ops": {"raw_prompts": {"config": {"path": str(path)}}}}).success
                result = drive(defs, instance, cursor=cursor, sensor_name="scoring__round_sensor", log_level="WARNING")
                assert result.launched and all(r.success for r in result.launched)
                cursor = result.cursor
                nights.append(instance.get_latest_materialization_event(dg.AssetKey(["scoring", "results"])).asset_materialization)
            first, second = (n.metadata for n in nights)
            assert nights[0].partition != nights[1].partition and second["records"].value == 44
            assert first["result_cache_hits"].value == 0 and first["result_cache_lookups"].value > 0
            computed = second["result_cache_lookups"].value - second["result_cache_hits"].value
            # every request of the 40 unchanged records is answered from night 1; the 4 new ones are computed
            assert second["result_cache_hits"].value >= first["result_cache_lookups"].value, (dict(first), dict(second))
            assert 4 <= computed <= 4 * 5, computed  # at most max_attempts requests per new record


def test_two_upstream_materialisations_in_the_same_second_start_two_runs(tmp_path: Path) -> None:
    # a run was named after its upstream event's second alone: two deps materialised by one
    # run of the user's (or one dep twice within a second) made one run name, and Dagster's
    # run-key dedup dropped the second start without a word
    paths = {name: tmp_path / f"{name}.jsonl" for name in ("prompts_a", "prompts_b")}
    for path in paths.values():
        write_input(path, 5)
    with create_defs_folder_sandbox() as sandbox:
        sandbox.scaffold_component(component_cls=BatchInferenceComponent, defs_path="scoring", defs_yaml_contents={
            "type": "batch_inference.BatchInferenceComponent",
            "attributes": {"spec": _spec(tmp_path), "deps": ["prompts_a", "prompts_b"]},
        })
        (sandbox.defs_folder_path / "user_assets.py").write_text(textwrap.dedent(f'''
            import dagster as dg

            @dg.asset
            def prompts_a() -> dg.MaterializeResult:
                return dg.MaterializeResult(metadata={{"path": dg.MetadataValue.path({str(paths["prompts_a"])!r})}})

            @dg.asset
            def prompts_b() -> dg.MaterializeResult:
                return dg.MaterializeResult(metadata={{"path": dg.MetadataValue.path({str(paths["prompts_b"])!r})}})
        '''))
        with sandbox.build_all_defs() as defs:
            instance = dg.DagsterInstance.ephemeral()
            sensor = defs.get_sensor_def("scoring__round_sensor")
            resources = dict(defs.resources or {})
            with dg.build_sensor_context(instance=instance, definitions=defs, sensor_name="scoring__round_sensor", resources=resources) as context:
                cursor = sensor.evaluate_tick(context).cursor
            assert dg.materialize([defs.get_assets_def("prompts_a"), defs.get_assets_def("prompts_b")], instance=instance).success
            records = [instance.fetch_materializations(dg.AssetKey(name), limit=1).records[0] for name in paths]
            # the same second, for certain: the second event as if it had landed in the first one's second
            from batch_inference.defs.rounds.sensors import start_action
            from batch_inference.defs.keys import PipelineKeys
            same_second = records[0]._replace(storage_id=records[0].storage_id + 1000)
            k = PipelineKeys(("scoring",))
            job = defs.get_job_def("scoring__start_pipeline_run")
            assert start_action(records[0], k, job).run_key != start_action(same_second, k, job).run_key
            with dg.build_sensor_context(instance=instance, definitions=defs, sensor_name="scoring__round_sensor", cursor=cursor,
                                         resources=resources) as context:
                tick = sensor.evaluate_tick(context)
            starts = [r for r in tick.run_requests or [] if r.job_name == "scoring__start_pipeline_run"]
            assert len(starts) == 2 and len({r.run_key for r in starts}) == 2, starts
            assert {str(p) for p in paths.values()} == {
                next(str(p) for p in paths.values() if str(p) in json.dumps(r.run_config)) for r in starts}
