"""Instance and deployment configs, validated offline against Dagster's own schemas.

No cluster here: each file is checked by the code that would load it (the instance
schema, then each configurable class's ``config_type()``), and the Helm values are
mapped (camelCase -> snake_case) onto the same schemas and compared with the instance
file they stand for.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from dagster._config import validate_config
from dagster._core.instance.config import dagster_instance_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "dagster"


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def snake_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {snake(k): snake_keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [snake_keys(v) for v in value]
    return value


def check_class_config(section: dict[str, Any]) -> type:
    """Import ``module.class`` of an instance section and validate its ``config`` against it."""
    klass = getattr(importlib.import_module(section["module"]), section["class"])
    result = validate_config(klass.config_type(), section.get("config", {}))
    assert result.success, [e.message for e in result.errors]
    return klass


@pytest.fixture(autouse=True)
def dagster_home(tmp_path, monkeypatch):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))


def test_local_instance_config():
    config, custom = dagster_instance_config(str(ROOT))
    assert custom is None
    assert "storage" not in config  # SQLite under $DAGSTER_HOME, Dagster's default
    assert config["concurrency"]["runs"]["max_concurrent_runs"] >= 1
    assert config["concurrency"]["pools"] == {"granularity": "op", "default_limit": 1}  # the GPU pool: one step at a time
    assert config["telemetry"]["enabled"] is False
    # The default launcher neither checks run-worker health nor resumes: monitoring only
    # fails runs stuck starting; the round sensor recovers dead STARTED runs.
    from dagster._core.launcher import DefaultRunLauncher, RunLauncher

    assert DefaultRunLauncher.supports_check_run_worker_health is RunLauncher.supports_check_run_worker_health
    assert DefaultRunLauncher.supports_resume_run is RunLauncher.supports_resume_run  # the base's False
    assert config["run_monitoring"]["enabled"] is True and config["run_monitoring"]["max_resume_run_attempts"] == 0
    assert not config.get("run_retries", {}).get("enabled", False)


def test_local_instance_loads(tmp_path):
    """The file as `make dev` uses it: copied into DAGSTER_HOME, loaded by Dagster."""
    from dagster import DagsterInstance

    (tmp_path / "dagster.yaml").write_text((ROOT / "dagster.yaml").read_text())
    instance = DagsterInstance.get()
    assert type(instance.run_coordinator).__name__ == "QueuedRunCoordinator"
    assert type(instance.run_launcher).__name__ == "DefaultRunLauncher"
    assert instance.run_monitoring_enabled and instance.run_monitoring_start_timeout_seconds == 180
    assert not instance.run_launcher.supports_check_run_worker_health and not instance.run_launcher.supports_resume_run
    concurrency = instance.get_concurrency_config()  # what the daemon's run queue and the executors read
    assert concurrency.run_queue_config.max_concurrent_runs == 2  # our setting, not a default
    assert concurrency.pool_config.default_pool_limit == 1  # the GPU pool's limit
    assert Path(instance.root_directory) == tmp_path
    assert type(instance.run_storage).__name__ == "SqliteRunStorage"
    assert str(tmp_path) in instance.run_storage._conn_string  # SQLite files under DAGSTER_HOME
    instance.dispose()


def test_k8s_instance_config():
    config, _ = dagster_instance_config(str(DEPLOY))
    assert set(config["storage"]) == {"postgres"}
    from dagster_postgres import DagsterPostgresStorage

    assert validate_config(DagsterPostgresStorage.config_type(), config["storage"]["postgres"]).success
    launcher = check_class_config(config["run_launcher"])
    assert launcher.__name__ == "K8sRunLauncher"
    logs = check_class_config(config["compute_logs"])
    assert logs.__name__ == "S3ComputeLogManager"
    assert config["concurrency"]["runs"]["tag_concurrency_limits"][0]["key"] == "batch_inference/gpu"
    assert config["concurrency"]["pools"] == {"granularity": "op", "default_limit": 4}  # the GPU pool across nodes
    assert config["telemetry"]["enabled"] is False
    # K8sRunLauncher checks run-worker health and resumes a run in a new pod.
    k8s = launcher.__new__(launcher)  # no cluster needed for these two properties
    assert k8s.supports_check_run_worker_health and k8s.supports_resume_run
    assert config["run_monitoring"]["enabled"] is True and config["run_monitoring"]["max_resume_run_attempts"] >= 1
    assert not config.get("run_retries", {}).get("enabled", False)


def test_helm_values_match_the_instance_config():
    values = yaml.safe_load((DEPLOY / "values.yaml").read_text())
    instance, _ = dagster_instance_config(str(DEPLOY))
    from dagster_aws.s3.compute_log_manager import S3ComputeLogManager
    from dagster_k8s import K8sRunLauncher

    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    launcher = snake_keys(values["runLauncher"]["config"]["k8sRunLauncher"])
    launcher["env_secrets"] = [s["name"] for s in launcher["env_secrets"]]  # chart: [{name}], instance: [name]
    launcher.pop("image_pull_policy")
    launcher["run_k8s_config"] = snake_keys(launcher["run_k8s_config"])
    # The chart fills these in itself (its own ConfigMap, service account, secret).
    chart_owned = ("instance_config_map", "service_account_name", "dagster_home", "postgres_password_secret")
    launcher.update({k: instance["run_launcher"]["config"][k] for k in chart_owned})
    result = validate_config(K8sRunLauncher.config_type(), launcher)
    assert result.success, [e.message for e in result.errors]
    for key in ("job_namespace", "env_secrets", "env_vars", "load_incluster_config", "run_k8s_config"):
        assert launcher[key] == instance["run_launcher"]["config"][key], key

    assert values["computeLogManager"]["type"] == "S3ComputeLogManager"
    logs = snake_keys(values["computeLogManager"]["config"]["s3ComputeLogManager"])
    assert validate_config(S3ComputeLogManager.config_type(), logs).success
    assert logs["prefix"] == instance["compute_logs"]["config"]["prefix"]

    assert values["dagsterDaemon"]["runCoordinator"]["type"] == "QueuedRunCoordinator"
    assert not values["dagsterDaemon"]["runCoordinator"]["config"]["queuedRunCoordinator"]  # the chart refuses both
    concurrency = values["concurrency"]
    assert {"runs": snake_keys(concurrency["runs"]), "pools": snake_keys(concurrency["pools"])} == instance["concurrency"]
    assert snake_keys(values["dagsterDaemon"]["runMonitoring"]) == instance["run_monitoring"]
    assert values["dagsterDaemon"]["runRetries"]["enabled"] is False
    assert values["postgresql"]["enabled"] is False and values["telemetry"]["enabled"] is False
    # the chart renders postgresqlScheme as postgres_db.scheme: the same driver as the file
    assert values["postgresql"]["postgresqlScheme"] == instance["storage"]["postgres"]["postgres_db"]["scheme"]
    deployment = values["dagster-user-deployments"]["deployments"][0]
    assert deployment["dagsterApiGrpcArgs"] == ["--module-name", "batch_inference.definitions"]


def test_gpu_steps_carry_valid_k8s_config():
    from dagster_k8s.job import get_user_defined_k8s_config

    from batch_inference.defs.rounds.assets import inferred, judge
    from batch_inference.defs.runs.assets import results, sharded, tail_retry

    for asset in (inferred, judge, tail_retry):
        tags = asset.op.tags
        config = get_user_defined_k8s_config(tags)  # raises on a schema error
        assert config.container_config["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert json.loads(tags["dagster-k8s/config"])["pod_spec_config"]["tolerations"]
    for asset in (sharded, results):
        assert "dagster-k8s/config" not in asset.op.tags


def test_k8s_job_executor_config_schema_accepts_our_step_config():
    from dagster_k8s import k8s_job_executor

    from batch_inference.defs.keys import GPU_K8S_CONFIG

    config = {"job_namespace": "batch-inference", "max_concurrent": 4,
              "per_step_k8s_config": {"inferred": GPU_K8S_CONFIG, "judge": GPU_K8S_CONFIG}}
    assert validate_config(k8s_job_executor.config_schema.config_type, config).success
    assert not validate_config(k8s_job_executor.config_schema.config_type, {"per_step_k8s_config": {"x": {"bogus": 1}}}).success


def test_workspace_points_at_the_definitions():
    workspace = yaml.safe_load((ROOT / "workspace.yaml").read_text())
    module = workspace["load_from"][0]["python_module"]["module_name"]
    assert hasattr(importlib.import_module(module), "defs")
