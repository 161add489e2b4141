"""Dagster's ``K8sRunLauncher`` with the settings of ``deploy/dagster/dagster.yaml``, on a real API server.

The instance is the deploy file's (Postgres storage on the ``postgres`` fixture, run
queue, run monitoring with resumes, the K8sRunLauncher section) with only what this
machine needs changed: the Postgres port, a kubeconfig instead of in-cluster config, and
the test's own job namespace. Launching a run creates the run's Job through the real
API server (its admission checks the ServiceAccount; its validation the pod spec Dagster
builds); the Job controller makes the pod, the node agent binds it and reports it
Running; ``check_run_worker_health`` follows the Job. In the first test the pod is a
status only and the test plays the container's exit (the node agent's ``exit-code``
annotation); in the last one the pod runs ``dagster api execute_run`` for real.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._core.code_pointer import ModuleCodePointer
from dagster._core.launcher import LaunchRunContext, WorkerStatus
from dagster._core.origin import JobPythonOrigin, RepositoryPythonOrigin
from kubernetes import client

from batch_inference_tests.defs.pg_instance import deploy_instance_config
from batch_inference_tests.fixtures.postgres import PostgresServer
from batch_inference_tests.k8s.cluster import K8sCluster
from batch_inference_tests.k8s.helpers import wait_until, write_k8s_instance
from batch_inference_tests.k8s.node_agent import EXIT_CODE

pytestmark = [pytest.mark.infra, pytest.mark.slow]
IMAGE = "ghcr.io/batch-inference/batch-inference:0.1.0"


@pytest.fixture
def k8s_instance(k8s: K8sCluster, namespace, postgres: PostgresServer, tmp_path: Path, monkeypatch) -> tuple[dg.DagsterInstance, str]:
    ns = namespace()
    db = postgres.create_database()
    for key, value in {**postgres.env(db), "BATCH_INFERENCE_POOL_ENDPOINTS": "http://10.244.0.9:8700",
                       "BATCH_INFERENCE_POOL_TOKEN": "pool-token"}.items():
        monkeypatch.setenv(key, value)
    config = deploy_instance_config(postgres, keep=("storage", "concurrency", "run_launcher", "run_monitoring", "telemetry"))
    home = write_k8s_instance(k8s, ns, config, tmp_path / "dagster_home", postgres_password="x")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    with dg.DagsterInstance.get() as instance:
        yield instance, ns


def _launch(instance: dg.DagsterInstance, job_name: str = "round_job") -> dg.DagsterRun:
    origin = JobPythonOrigin(job_name, RepositoryPythonOrigin(
        executable_path="/usr/local/bin/python", code_pointer=ModuleCodePointer("batch_inference.definitions", "defs", None),
        container_image=IMAGE))
    run = instance.add_run(dg.DagsterRun(job_name=job_name, run_id=str(uuid.uuid4()), job_code_origin=origin,
                                         status=dg.DagsterRunStatus.STARTING))
    instance.run_launcher.launch_run(LaunchRunContext(dagster_run=run, workspace=None))
    return instance.get_run_by_id(run.run_id)


def _pod(k8s: K8sCluster, ns: str, run: dg.DagsterRun) -> client.V1Pod | None:
    pods = client.CoreV1Api(k8s.api_client()).list_namespaced_pod(ns, label_selector=f"dagster/run-id={run.run_id}").items
    return pods[0] if pods else None


def test_the_k8s_run_launcher_creates_the_run_job_and_follows_it(k8s: K8sCluster, k8s_instance) -> None:
    instance, ns = k8s_instance
    from dagster_k8s import K8sRunLauncher

    assert isinstance(instance.run_launcher, K8sRunLauncher) and instance.run_launcher.supports_resume_run
    run = _launch(instance)
    job = client.BatchV1Api(k8s.api_client()).read_namespaced_job(f"dagster-run-{run.run_id}", ns)
    spec = job.spec.template.spec
    (c,) = spec.containers
    assert c.image == IMAGE and c.args[:5] == ["/usr/local/bin/python", "-m", "dagster", "api", "execute_run"]
    assert spec.service_account_name == "dagster" and job.spec.backoff_limit == 0
    assert c.resources.requests == {"cpu": "500m", "memory": "1Gi"} and c.resources.limits == {"memory": "2Gi"}
    env = {e.name: e for e in c.env}
    assert env["DAGSTER_PG_PASSWORD"].value_from.secret_key_ref.name == "dagster-postgresql-secret"
    assert env["BATCH_INFERENCE_POOL_TOKEN"].value == "pool-token"  # env_vars: copied from the launcher's env
    assert [s.secret_ref.name for s in c.env_from] == ["batch-inference-s3"]
    assert env["DAGSTER_HOME"].value == "/opt/dagster/dagster_home"  # the instance itself travels in the args (instance_ref)

    launcher = instance.run_launcher
    pod = wait_until(lambda: (p := _pod(k8s, ns, run)) is not None and p.status.phase == "Running" and p, 60, "the run pod Running")
    assert pod.spec.node_name == "gpu-node-0"
    started = instance.get_run_by_id(run.run_id)
    assert launcher.check_run_worker_health(started).status == WorkerStatus.RUNNING
    # the run worker's container exits 0: the Job succeeds, and the launcher sees it
    client.CoreV1Api(k8s.api_client()).patch_namespaced_pod(pod.metadata.name, ns, {"metadata": {"annotations": {EXIT_CODE: "0"}}})
    wait_until(lambda: launcher.check_run_worker_health(started).status == WorkerStatus.SUCCESS, 60, "the Job to succeed")

    # a run worker that dies (a spot node reclaimed, OOM): the Job fails, health says so, and the
    # instance's run monitoring (max_resume_run_attempts from the file) would resume it
    crashed = _launch(instance)
    pod = wait_until(lambda: (p := _pod(k8s, ns, crashed)) is not None and p.status.phase == "Running" and p, 60, "the pod Running")
    client.CoreV1Api(k8s.api_client()).patch_namespaced_pod(pod.metadata.name, ns, {"metadata": {"annotations": {EXIT_CODE: "137"}}})
    instance.handle_run_event(crashed.run_id, dg.DagsterEvent(  # the run had started before its worker died
        event_type_value=dg.DagsterEventType.RUN_START.value, job_name=crashed.job_name))
    running = instance.get_run_by_id(crashed.run_id)
    assert running.status == dg.DagsterRunStatus.STARTED
    result = wait_until(lambda: (h := launcher.check_run_worker_health(running)).status == WorkerStatus.FAILED and h, 60, "FAILED")
    assert "no active pods" in (result.msg or "") or "failed" in (result.msg or "")
    assert instance.run_monitoring_max_resume_run_attempts == 3


def test_a_run_pod_executes_its_dagster_run_on_the_cluster(k8s: K8sCluster, namespace, tmp_path: Path, monkeypatch) -> None:
    """The whole way: the run Job's pod runs ``dagster api execute_run`` (the node agent runs the
    container's args in the pod's network namespace), which loads this project's definitions,
    executes ``start_pipeline_run`` and writes its events to the instance's Postgres, reached
    from the pod at the cluster address, as a run pod reaches its database."""
    import sys

    from batch_inference.definitions import defs as project_defs
    from batch_inference_tests.defs.helpers import simulated_spec, write_input
    from batch_inference_tests.fixtures.infra import free_port
    from batch_inference_tests.k8s.cluster import GATEWAY

    ns = namespace(live=True)
    pg = PostgresServer(port=free_port(), listen=f"127.0.0.1,{GATEWAY}", wrap=k8s.in_netns)  # on the cluster network
    try:
        pg.start()
        k8s.forward(pg.port, listen_port=pg.port)  # and at the same port on this side, for the test's instance
        db = pg.create_database()
        for key, value in pg.env(db).items():
            monkeypatch.setenv(key, value)
        config = deploy_instance_config(pg, keep=("storage", "run_launcher", "telemetry"))
        home = write_k8s_instance(k8s, ns, config, tmp_path / "dagster_home", postgres_password=pg.env(db)["DAGSTER_PG_PASSWORD"],
                                  env_secrets=[], env_vars=[f"DAGSTER_PG_HOST={GATEWAY}", f"DAGSTER_PG_USER={pg.env(db)['DAGSTER_PG_USER']}",
                                                            f"DAGSTER_PG_DB={db}", "BATCH_INFERENCE_POOL_MODE=inprocess"])
        spec_path = tmp_path / "spec.yaml"
        spec_path.write_text(yaml.safe_dump(simulated_spec("in-a-pod", write_input(tmp_path / "in.jsonl", 40), tmp_path / "runs")))
        monkeypatch.setenv("DAGSTER_HOME", str(home))
        with dg.DagsterInstance.get() as instance:
            origin = JobPythonOrigin("start_pipeline_run", RepositoryPythonOrigin(
                executable_path=sys.executable, code_pointer=ModuleCodePointer("batch_inference.definitions", "defs", None),
                container_image=IMAGE))
            run = instance.create_run_for_job(
                project_defs.resolve_job_def("start_pipeline_run"), job_code_origin=origin, status=dg.DagsterRunStatus.STARTING,
                run_config={"ops": {"start_run": {"config": {"spec_path": str(spec_path)}}}})
            instance.run_launcher.launch_run(LaunchRunContext(dagster_run=run, workspace=None))
            try:
                done = wait_until(lambda: (r := instance.get_run_by_id(run.run_id)).is_finished and r, 90, "the run to finish")
            except AssertionError:
                pod = _pod(k8s, ns, run)
                raise AssertionError(f"pod {pod and pod.status.phase}: {pod and k8s.pod_log(pod.metadata.uid)}\n"
                                     f"{k8s.log_tail('node-agent')}") from None
            events = [e.dagster_event.event_type_value for e in instance.all_logs(run.run_id) if e.dagster_event]
            assert done.status == dg.DagsterRunStatus.SUCCESS, events[-5:]
            assert "ASSET_MATERIALIZATION" in events  # source_dataset[in-a-pod], written from the pod
            wait_until(lambda: instance.run_launcher.check_run_worker_health(done).status == WorkerStatus.SUCCESS, 60,
                       "the run Job to succeed")
            pod = _pod(k8s, ns, run)
            assert pod is not None and pod.status.pod_ip.startswith("10.244.0.")
    finally:
        pg.stop()
