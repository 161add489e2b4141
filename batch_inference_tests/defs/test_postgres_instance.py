"""The Dagster instance of ``deploy/dagster/dagster.yaml`` on a real PostgreSQL 15.

Run, event-log and schedule storage in Postgres (``dagster-postgres``), the deploy file's
queue and monitoring settings: the file loads, a whole pipeline runs through Dagster
on it (schedule tick -> start run -> round sensor -> results), and the round sensor's
crash recovery works on it. The server is started by the ``postgres`` fixture.
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

import dagster as dg
import pytest

from batch_inference.defs.driver import drive
from batch_inference.defs.keys import RESULTS
from batch_inference.defs.runs.schedules import build_pipeline_schedule
from batch_inference.storage import JsonlFile
from batch_inference_tests.defs.helpers import write_input
from batch_inference_tests.defs.pg_instance import deploy_instance_home
from batch_inference_tests.fixtures.postgres import PostgresServer
from batch_inference_tests.fixtures.seaweedfs import SeaweedServer

pytestmark = pytest.mark.infra


@pytest.fixture
def pg_instance(tmp_path: Path, postgres: PostgresServer, monkeypatch: pytest.MonkeyPatch) -> dg.DagsterInstance:
    db = postgres.create_database()
    for key, value in postgres.env(db).items():
        monkeypatch.setenv(key, value)
    home = deploy_instance_home(tmp_path / "dagster_home", postgres)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    with dg.DagsterInstance.get() as instance:
        yield instance


@pytest.fixture
def pg_s3_instance(tmp_path: Path, postgres: PostgresServer, seaweedfs: SeaweedServer,
                   monkeypatch: pytest.MonkeyPatch) -> dg.DagsterInstance:
    """The same plus the deploy file's compute logs (S3ComputeLogManager) on SeaweedFS, set up
    through the environment variables the file reads (credentials: boto3's own chain)."""
    db = postgres.create_database()
    bucket = seaweedfs.make_bucket()[5:]
    env = {**postgres.env(db), "DAGSTER_LOGS_BUCKET": bucket, "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL_S3": seaweedfs.endpoint_url, "AWS_ACCESS_KEY_ID": seaweedfs.key,
           "AWS_SECRET_ACCESS_KEY": seaweedfs.secret}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    keep = ("storage", "concurrency", "run_monitoring", "compute_logs", "telemetry")
    home = deploy_instance_home(tmp_path / "dagster_home", postgres, keep=keep)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    with dg.DagsterInstance.get() as instance:
        yield instance


def test_the_deploy_instance_loads_and_stores_in_postgres(pg_instance: dg.DagsterInstance, postgres: PostgresServer) -> None:
    # with the pinned SQLAlchemy 2.1, dagster-postgres' default scheme picks the psycopg (v3)
    # driver, which is not installed: the file names psycopg2 (what dagster-postgres ships with)
    from dagster_postgres import PostgresEventLogStorage, PostgresRunStorage, PostgresScheduleStorage

    assert isinstance(pg_instance.run_storage, PostgresRunStorage)
    assert isinstance(pg_instance.event_log_storage, PostgresEventLogStorage)
    assert isinstance(pg_instance.schedule_storage, PostgresScheduleStorage)
    run = pg_instance.add_run(dg.DagsterRun(job_name="probe", run_id="0" * 8 + "-0000-0000-0000-" + "0" * 12))
    assert pg_instance.get_run_by_id(run.run_id).job_name == "probe"
    assert pg_instance.run_coordinator.__class__.__name__ == "QueuedRunCoordinator"
    db = pg_instance.run_storage.postgres_url.rsplit("/", 1)[1]
    assert postgres.psql("SELECT pipeline_name FROM runs", db=db) == "probe"


def _count(postgres: PostgresServer, instance: dg.DagsterInstance, sql: str) -> int:
    return int(postgres.psql(sql, db=instance.run_storage.postgres_url.rsplit("/", 1)[1]))


@pytest.mark.slow
def test_a_whole_pipeline_runs_through_dagster_on_postgres(pg_s3_instance, postgres, seaweedfs, defs, write_spec,
                                                           tmp_path) -> None:
    pg_instance = pg_s3_instance
    spec_path = write_spec("base", records=10, approval=0.5)
    write_input(tmp_path / "drops" / "20261129" / "prompts.jsonl", 60, prefix="night-")
    schedule = build_pipeline_schedule(str(spec_path), cron_schedule="0 2 * * *",
                                       input_template=str(tmp_path / "drops" / "{date}" / "prompts.jsonl"))
    when = dt.datetime(2026, 11, 29, 2, 0, tzinfo=dt.timezone.utc)
    with dg.build_schedule_context(instance=pg_instance, scheduled_execution_time=when) as context:
        request = schedule.evaluate_tick(context).run_requests[0]
    started = defs.resolve_job_def(schedule.job_name).execute_in_process(
        run_config=request.run_config, instance=pg_instance, tags=request.tags)
    assert started.success

    result = drive(defs, pg_instance, log_level="WARNING")
    jobs = [r.job_name for r in result.launched]
    assert jobs[0] == "shard_job" and jobs.count("round_job") >= 2 and jobs[-1] == "results_job", jobs
    assert all(r.success for r in result.launched)
    res = pg_instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=RESULTS, asset_partitions=["nightly-20261129"]), limit=1).records[0]
    meta = {k: v.value for k, v in res.asset_materialization.metadata.items()}
    assert meta["records"] == 60 and meta["approved"] + meta["exhausted"] + meta["failed"] == 60, meta
    assert meta["conservation_ok"] is True and meta["status"] in ("converged", "exhausted")
    # what the daemon would read back lives in Postgres tables, not in memory
    assert _count(postgres, pg_instance, "SELECT count(*) FROM runs") == len(pg_instance.get_runs()) == len(result.launched) + 1
    assert _count(postgres, pg_instance, "SELECT count(*) FROM event_logs WHERE dagster_event_type = 'ASSET_MATERIALIZATION'") >= 10
    assert _count(postgres, pg_instance, "SELECT count(*) FROM dynamic_partitions WHERE partitions_def_name = 'round_numbers'") >= 2
    assert _count(postgres, pg_instance, "SELECT count(*) FROM asset_check_executions WHERE execution_status = 'SUCCEEDED'") >= 1
    # every run's step output went to S3 (compute_logs of the deploy file), readable back through the instance
    from dagster_aws.s3.compute_log_manager import S3ComputeLogManager

    assert isinstance(pg_instance.compute_log_manager, S3ComputeLogManager)
    fs = JsonlFile(f"s3://{os.environ['DAGSTER_LOGS_BUCKET']}/x", storage_options=seaweedfs.storage_options).fs
    keys = fs.find(f"{os.environ['DAGSTER_LOGS_BUCKET']}/dagster/compute-logs")
    assert {k.split("/")[4] for k in keys} >= {r.run_id for r in result.launched}, keys[:5]  # .../storage/<run id>/...


@pytest.mark.slow
def test_the_round_sensor_recovers_a_sigkilled_round_run_on_postgres(pg_instance, tmp_path: Path) -> None:
    from batch_inference_tests.defs.crash_scenario import sigkill_a_round_run_and_recover

    sigkill_a_round_run_and_recover(tmp_path, Path(pg_instance.root_directory))
    keys = {r.tags.get("dagster/run_key") for r in pg_instance.get_runs()}  # this instance: Postgres, not SQLite
    assert {"spot|r00:retry-1", "spot:results"} <= keys
