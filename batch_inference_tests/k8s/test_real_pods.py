"""The worker pool on real pods: the project's image run by a real kubelet, containerd and runc.

``k8s_node`` (``conftest.py``, ``node.py``) is a cluster with a real node: the pods here
are containers of the image ``deploy/image/build.sh`` builds, scheduled by kube-scheduler,
with the pool's token Secret and engine ConfigMap mounted by the kubelet, run as
``runAsUser: 1000`` with their resource requests, Ready only once the kubelet's readiness
probe reaches the worker's ``/health``, and a Service whose ClusterIP kube-proxy serves.

Storage: the run's folder is a ``hostPath`` volume mounted at the same path in every pod
(standing in for the shared S3 bucket production uses), so the driver and the workers
see the same shards.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import yaml
from kubernetes import client

from batch_inference.pipeline import PipelineSpec
from batch_inference.pool.launchers.k8s import K8sLauncher
from batch_inference_tests.faults.helpers import assert_conserved
from batch_inference_tests.k8s.cluster import K8sCluster
from batch_inference_tests.k8s.helpers import wait_until
from batch_inference_tests.k8s.node import RealNode

# bounded: the first test also pays the node (control plane, kubelet, the image imported: ~2-4 min)
pytestmark = [pytest.mark.infra, pytest.mark.pods, pytest.mark.slow, pytest.mark.timeout(900)]
IMAGE = "batch-inference:0.1.0-cpu"  # what deploy/image/build.sh tags the cpu variant
LABELS = "app.kubernetes.io/name=batch-inference-worker"


class _SharedFolderLauncher(K8sLauncher):
    """The pool's own manifests, plus the test's run folder as a hostPath at the same path."""

    def __init__(self, *args: Any, folder: Path, judge_url: str | None = None, liveness: dict[str, Any] | None = None,
                 **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.folder = folder
        self.judge_url = judge_url
        self.liveness = liveness or {}  # overrides of the manifest's livenessProbe timing (a test cannot wait 2 min)

    def judge_endpoints(self) -> list[str]:
        """The judge pool's Service by its ClusterIP: this sandbox has no cluster DNS (no
        CoreDNS package), so ``<name>.<ns>.svc.cluster.local`` does not resolve here; the
        address, kube-proxy's rules and everything behind them are the real ones."""
        return [self.judge_url] if self.judge_url else super().judge_endpoints()

    def render(self, **kw: Any) -> list[dict[str, Any]]:
        objs = super().render(**kw)
        for obj in objs:
            if obj["kind"] == "Deployment":
                pod = obj["spec"]["template"]["spec"]
                pod["volumes"].append({"name": "runs", "hostPath": {"path": str(self.folder), "type": "Directory"}})
                pod["containers"][0]["volumeMounts"].append({"name": "runs", "mountPath": str(self.folder)})
                pod["containers"][0]["livenessProbe"].update(self.liveness)
        return objs


def _namespace(k8s: K8sCluster) -> str:
    name = f"pods-{os.urandom(4).hex()}"
    client.CoreV1Api(k8s.api_client()).create_namespace({"metadata": {"name": name}})
    return name


def _launcher(k8s: K8sCluster, ns: str, folder: Path, engine: dict[str, Any], **kw: Any) -> _SharedFolderLauncher:
    api = k8s.api_client()
    folder.chmod(0o777)  # the workers run as uid 1000
    return _SharedFolderLauncher(engine, image=IMAGE, namespace=ns, gpus=1, cpu="100m", memory="400Mi",
                                 storage_roots=[str(folder)], folder=folder, grace_s=5,
                                 apps_api=client.AppsV1Api(api), core_api=client.CoreV1Api(api), **kw)


def _pods(k8s: K8sCluster, ns: str, labels: str = LABELS) -> list[Any]:
    return [p for p in client.CoreV1Api(k8s.api_client()).list_namespaced_pod(ns, label_selector=labels).items
            if not p.metadata.deletion_timestamp]


def _in_netns(k8s: K8sCluster, url: str, token: str | None = None) -> str:
    """GET ``url`` from the cluster network (where a Dagster run pod would be)."""
    code = ("import sys, urllib.request; r = urllib.request.Request(sys.argv[1], "
            "headers={'Authorization': 'Bearer ' + sys.argv[2]} if sys.argv[2] else {}); "
            "print(urllib.request.urlopen(r, timeout=10).read().decode())")
    out = subprocess.run(k8s.in_netns([sys.executable, "-c", code, url, token or ""]), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _grant_discovery(k8s: K8sCluster, ns: str) -> None:
    """RBAC: the pipeline's identity may read this namespace's Endpoints and nothing else."""
    rbac = client.RbacAuthorizationV1Api(k8s.api_client())
    rbac.create_namespaced_role(ns, {"metadata": {"name": "pool-discovery"}, "rules": [
        {"apiGroups": [""], "resources": ["endpoints"], "verbs": ["get"]}]})
    rbac.create_namespaced_role_binding(ns, {"metadata": {"name": "pool-discovery"},
                                             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pool-discovery"},
                                             "subjects": [{"kind": "User", "name": "pipeline", "apiGroup": "rbac.authorization.k8s.io"}]})


def _spec(tmp_path: Path, run: str, ns: str, launcher: K8sLauncher, engine: dict[str, Any], n: int) -> tuple[Path, list[str]]:
    ids = [f"p{i:05d}" for i in range(n)]
    (tmp_path / "input.jsonl").write_bytes(b"".join(orjson.dumps({"id": i, "prompt": f"question {i}"}) + b"\n" for i in ids))
    spec = {"run": run, "input": str(tmp_path / "input.jsonl"), "output": str(tmp_path / "out"), "engine": engine,
            "infer": {"template": "{prompt}", "sampling": {"max_tokens": 8, "temperature": 1.0, "seed": 1}},
            "judge": {"kind": "rule", "callable": "regex", "kwargs": {"pattern": "^APPROVED"}},
            "strategy": "rounds", "max_rounds": 3, "shard_records": 25, "chunk_size": 25,
            "pool": {"launcher": "k8s", "k8s_name": launcher.name, "namespace": ns, "token_env": "POOL_TOKEN",
                     "replicas": launcher.replicas, "concurrency": launcher.concurrency, "ready_timeout_s": 120,
                     "retries": 3}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    return tmp_path / "spec.yaml", ids


def _driver(k8s: K8sCluster, spec: Path, launcher: K8sLauncher) -> list[str]:
    """The driver on the cluster network, as a Dagster run pod would be. umask 000: the
    driver (root here) and the workers (uid 1000) write into one folder, which stands in
    for the S3 bucket production shares (a bucket has no file owners)."""
    cli = str(Path(sys.executable).parent / "batch-inference")
    return k8s.in_netns(["sh", "-c", 'umask 000 && exec "$@"', "driver", cli, "run", str(spec)])


def _driver_env(k8s: K8sCluster, launcher: K8sLauncher) -> dict[str, str]:
    return {**os.environ, "KUBECONFIG": str(k8s.kubeconfig_file("pipeline", inside=True)), "POOL_TOKEN": launcher.token or ""}


def test_the_pool_runs_as_pods_of_the_image_and_a_run_ends_whole(k8s_node: tuple[K8sCluster, RealNode], tmp_path: Path) -> None:
    k8s, node = k8s_node
    ns = _namespace(k8s)
    engine = {"kind": "simulated", "simulated": {"latency_a_s": 0.002, "latency_b_s": 0.0, "approval_rate": 0.6}}
    launcher = _launcher(k8s, ns, tmp_path, engine, replicas=2, concurrency=2)
    endpoints = launcher.up(wait_s=240, poll_s=0.5)
    assert len(endpoints) == 2 and all(e.startswith("http://10.244.0.") and e.endswith(":8700") for e in endpoints)

    pods = _pods(k8s, ns)
    assert len(pods) == 2
    for pod in pods:  # scheduled by kube-scheduler onto the real node, Ready by the kubelet's probe
        assert pod.spec.node_name == node.name and pod.status.phase == "Running", pod.status
        status = pod.status.container_statuses[0]
        assert status.ready and status.image.endswith(IMAGE) and status.container_id.startswith("containerd://")
        requests = pod.spec.containers[0].resources.requests
        assert requests["cpu"] == "100m" and requests["memory"] == "400Mi" and requests["nvidia.com/gpu"] == "1"
        # the container's process runs as runAsUser in the image's venv, inside the memory limit runc set
        container_id = status.container_id.split("//", 1)[1]
        pid = int(node.ctr("tasks", "ls").split(container_id, 1)[1].split()[0])
        uid_line = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Uid:"))
        assert uid_line.split()[1] == "1000", uid_line
        assert "/opt/venv/bin/python" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ")
        cgroup = next(line.split(":", 2)[2] for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
                      if ":memory:" in line)
        limit = int(Path(f"/sys/fs/cgroup/memory{cgroup}/memory.limit_in_bytes").read_text())
        assert limit == 400 * 2**20, (cgroup, limit)
    for endpoint in endpoints:  # the worker holds the token from the Secret the kubelet mounted, the engine from the ConfigMap
        stats = json.loads(_in_netns(k8s, endpoint + "/stats", launcher.token))
        assert stats["worker"].startswith(f"{launcher.name}-") and stats["engine"].startswith("simulated"), stats
    # the Service's ClusterIP, served by kube-proxy's iptables rules inside the cluster network
    svc = client.CoreV1Api(k8s.api_client()).read_namespaced_service(launcher.name, ns)
    assert json.loads(_in_netns(k8s, f"http://{svc.spec.cluster_ip}:8700/health"))

    _grant_discovery(k8s, ns)
    spec, ids = _spec(tmp_path, "on-pods", ns, launcher, engine, 300)
    run = subprocess.run(_driver(k8s, spec, launcher), env=_driver_env(k8s, launcher), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode in (0, 3), run.stdout[-3000:] + run.stderr[-3000:]
    summary = orjson.loads((tmp_path / "out" / "on-pods" / "ledger" / "run.json").read_bytes())
    assert summary["conservation"]["ok"] and summary["records"] == 300, summary
    assert_conserved(PipelineSpec.load(spec), ids)
    served = {e: json.loads(_in_netns(k8s, e + "/stats", launcher.token))["tasks_completed"] for e in endpoints}
    assert all(n > 0 for n in served.values()), served
    launcher.down()


def test_spot_reclaim_pods_deleted_mid_task_lose_no_record(k8s_node: tuple[K8sCluster, RealNode], tmp_path: Path) -> None:
    """Two worker pods deleted with grace period 0 while they hold tasks, as a spot reclaim
    takes a machine: the Deployment replaces them, the pipeline retries their tasks, and every
    record ends in exactly one terminal state (read back from storage by ``assert_conserved``)."""
    k8s, node = k8s_node
    ns = _namespace(k8s)
    # ~1 s per batch: a 25-record task keeps a worker busy long enough to be killed mid-task
    engine = {"kind": "simulated", "simulated": {"latency_a_s": 1.0, "latency_b_s": 0.0, "approval_rate": 0.5}}
    launcher = _launcher(k8s, ns, tmp_path, engine, replicas=3, concurrency=2)
    launcher.up(wait_s=240, poll_s=0.5)
    _grant_discovery(k8s, ns)
    spec, ids = _spec(tmp_path, "reclaimed", ns, launcher, engine, 600)
    core = client.CoreV1Api(k8s.api_client())
    log = (tmp_path / "driver.log").open("w")
    driver = subprocess.Popen(_driver(k8s, spec, launcher), env=_driver_env(k8s, launcher), stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    killed: list[str] = []
    try:
        for _ in range(2):
            def busy() -> str | None:
                for pod in _pods(k8s, ns):
                    if pod.metadata.name in killed or not pod.status.pod_ip:
                        continue
                    try:
                        stats = json.loads(_in_netns(k8s, f"http://{pod.status.pod_ip}:8700/stats", launcher.token))
                    except AssertionError:
                        continue
                    if stats["tasks_running"] > 0:
                        return pod.metadata.name
                return None

            deadline = time.monotonic() + 120
            while (victim := busy()) is None:
                assert driver.poll() is None, "the run ended before a pod could be reclaimed"
                assert time.monotonic() < deadline, "no worker pod busy with a task after 120 s"
            core.delete_namespaced_pod(victim, ns, grace_period_seconds=0)
            killed.append(victim)
            time.sleep(1.0)
        rc = driver.wait(timeout=600)
    finally:
        if driver.poll() is None:
            driver.kill()
        log.close()
    out = (tmp_path / "driver.log").read_text()
    # no shard quarantined: a task that cannot reach a worker (its pod deleted, the Endpoints
    # still listing it) waits for a replacement without spending its retries (PoolClient)
    assert rc in (0, 3), out[-4000:]
    summary = orjson.loads((tmp_path / "out" / "reclaimed" / "ledger" / "run.json").read_bytes())
    assert summary["conservation"]["ok"] and summary["records"] == 600, summary
    counts = assert_conserved(PipelineSpec.load(spec), ids)
    assert sum(counts.values()) == 600 and not counts.get("failed"), counts
    # the deleted pods are gone and the Deployment replaced them
    wait_until(lambda: len([p for p in _pods(k8s, ns) if p.metadata.name not in killed]) == 3, 120, "3 replacement pods")
    print(f"SPOT RECLAIM: deleted {killed} mid-task; terminal states {dict(counts)}")
    launcher.down()


def test_a_hung_worker_fails_its_liveness_probe_and_the_kubelet_restarts_it(
        k8s_node: tuple[K8sCluster, RealNode], tmp_path: Path) -> None:
    """A worker that stops answering (its process frozen with SIGSTOP: a wedged engine, a
    deadlock) leaves the Service's Endpoints by its readiness probe, fails the manifest's
    liveness probe (its period shortened here), and the kubelet kills and restarts its
    container in the same pod; the pool then serves a run whole again."""
    k8s, node = k8s_node
    ns = _namespace(k8s)
    engine = {"kind": "simulated", "simulated": {"latency_a_s": 0.002, "latency_b_s": 0.0, "approval_rate": 0.6}}
    launcher = _launcher(k8s, ns, tmp_path, engine, replicas=1, concurrency=2,
                         liveness={"periodSeconds": 2, "failureThreshold": 2, "timeoutSeconds": 1})
    launcher.up(wait_s=240, poll_s=0.5)
    (pod,) = _pods(k8s, ns)
    status = pod.status.container_statuses[0]
    assert status.restart_count == 0
    pid = int(node.ctr("tasks", "ls").split(status.container_id.split("//", 1)[1], 1)[1].split()[0])
    os.kill(pid, signal.SIGSTOP)  # the worker hangs: /health never answers
    core = client.CoreV1Api(k8s.api_client())

    def restarted() -> bool:
        statuses = core.read_namespaced_pod(pod.metadata.name, ns).status.container_statuses or []
        return bool(statuses) and statuses[0].restart_count >= 1 and statuses[0].ready

    wait_until(restarted, 120, "the kubelet restarting the hung worker's container")
    (again,) = _pods(k8s, ns)
    assert again.metadata.name == pod.metadata.name  # the same pod: the kubelet restarted its container
    events = core.list_namespaced_event(ns, field_selector=f"involvedObject.name={pod.metadata.name}").items
    assert any("Liveness probe failed" in (e.message or "") for e in events), [e.message for e in events]
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)  # gone with its container; nothing left stopped
    _grant_discovery(k8s, ns)
    spec, ids = _spec(tmp_path, "after-restart", ns, launcher, engine, 100)
    run = subprocess.run(_driver(k8s, spec, launcher), env=_driver_env(k8s, launcher), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode in (0, 3), run.stdout[-3000:] + run.stderr[-3000:]
    assert_conserved(PipelineSpec.load(spec), ids)
    launcher.down()


def test_the_judge_s_own_pool_on_pods_judges_the_tail_reached_through_its_service(
        k8s_node: tuple[K8sCluster, RealNode], tmp_path: Path) -> None:
    """Strategy 2 with a judge model of its own, as ``deploy/k8s/with-judge`` deploys it: the
    infer workers' retry tasks send each wave to the judge pool's Service (ClusterIP, kube-proxy)
    with the judge pool's token, mounted from its own Secret by the kubelet. The infer model never
    approves and the judge model always does, so every approval is the judge pool's."""
    k8s, node = k8s_node
    ns = _namespace(k8s)
    never = {"kind": "simulated", "seed": 0, "simulated": {"latency_a_s": 0.002, "latency_b_s": 0.0, "approval_rate": 0.0}}
    always = {"kind": "simulated", "seed": 1, "simulated": {"latency_a_s": 0.002, "latency_b_s": 0.0, "approval_rate": 1.0}}
    judge = _launcher(k8s, ns, tmp_path, always, name="batch-inference-worker-judge", replicas=1, concurrency=4)
    judge_endpoints = judge.up(wait_s=240, poll_s=0.5)
    svc = client.CoreV1Api(k8s.api_client()).read_namespaced_service(judge.name, ns)
    infer = _launcher(k8s, ns, tmp_path, never, replicas=2, concurrency=2, judge=judge,
                      judge_url=f"http://{svc.spec.cluster_ip}:{judge.port}")
    endpoints = infer.up(wait_s=240, poll_s=0.5)
    assert len(endpoints) == 2 and len(judge_endpoints) == 1
    (pod,) = [p for p in _pods(k8s, ns, "app.kubernetes.io/instance=batch-inference-worker-judge")]
    assert pod.spec.node_name == node.name and pod.status.container_statuses[0].ready

    _grant_discovery(k8s, ns)
    spec, ids = _spec(tmp_path, "judged-on-pods", ns, infer, never, 200)
    body = yaml.safe_load(spec.read_text())
    body.update(strategy="in_place", max_attempts=3)
    body["judge"] = {"kind": "llm", "template": "Judge this answer: {result}", "engine": always,
                     "pool": {"token_env": "JUDGE_POOL_TOKEN", "replicas": 1, "concurrency": 4}}
    spec.write_text(yaml.safe_dump(body))
    env = {**_driver_env(k8s, infer), "JUDGE_POOL_TOKEN": judge.token or ""}
    run = subprocess.run(_driver(k8s, spec, infer), env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    counts = assert_conserved(PipelineSpec.load(spec), ids)
    assert counts == {"approved": 200}, counts  # only the judge pool's model approves
    judged = json.loads(_in_netns(k8s, judge_endpoints[0] + "/stats", judge.token))
    assert judged["tasks_completed"] > 0 and judged["records_done"] >= 200, judged
    print(f"JUDGE POOL ON PODS: {dict(counts)}; judge pod served {judged['tasks_completed']} wave tasks")
    infer.down()
    judge.down()


def _container_log(pod: Any) -> str:
    """What the kubelet kept of a pod's container output (``/var/log/pods``)."""
    folder = Path("/var/log/pods") / f"{pod.metadata.namespace}_{pod.metadata.name}_{pod.metadata.uid}"
    return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(folder.glob("*/*.log"))) or f"(no log in {folder})"


@contextlib.contextmanager
def _run_instance(k8s: K8sCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, str]]:
    """The deploy instance (Postgres storage, its K8sRunLauncher section) aimed at a namespace of
    the real node's cluster, with what the Helm chart creates beside the runs (ServiceAccount,
    Secrets, the instance ConfigMap a run pod mounts); Postgres listens on the cluster network."""
    import dagster as dg

    from batch_inference_tests.defs.pg_instance import deploy_instance_config
    from batch_inference_tests.fixtures.infra import free_port
    from batch_inference_tests.fixtures.postgres import PostgresServer
    from batch_inference_tests.k8s.cluster import GATEWAY
    from batch_inference_tests.k8s.helpers import write_k8s_instance

    ns = _namespace(k8s)
    tmp_path.chmod(0o777)  # the run pod runs as uid 1000 and writes the run's folder
    pg = PostgresServer(port=free_port(), listen=f"127.0.0.1,{GATEWAY}", wrap=k8s.in_netns)
    try:
        pg.start()
        k8s.forward(pg.port, listen_port=pg.port)  # and at the same port on this side, for the test's instance
        db = pg.create_database()
        env = pg.env(db)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        config = deploy_instance_config(pg, keep=("storage", "run_launcher", "telemetry"))
        # the image's DAGSTER_HOME holds the mounted dagster.yaml only: artifacts (and step logs) go to /tmp
        config["local_artifact_storage"] = {"module": "dagster._core.storage.root", "class": "LocalArtifactStorage",
                                            "config": {"base_dir": "/tmp/dagster"}}
        home = write_k8s_instance(
            k8s, ns, config, tmp_path / "dagster_home", postgres_password=env["DAGSTER_PG_PASSWORD"], env_secrets=[],
            env_vars=[f"DAGSTER_PG_HOST={GATEWAY}", f"DAGSTER_PG_USER={env['DAGSTER_PG_USER']}", f"DAGSTER_PG_DB={db}",
                      "BATCH_INFERENCE_POOL_MODE=inprocess"],
            volumes=[{"name": "runs", "host_path": {"path": str(tmp_path), "type": "Directory"}}],
            volume_mounts=[{"name": "runs", "mount_path": str(tmp_path)}])
        client.CoreV1Api(k8s.api_client()).create_namespaced_config_map(ns, {
            "metadata": {"name": config["run_launcher"]["config"]["instance_config_map"]},
            "data": {"dagster.yaml": (home / "dagster.yaml").read_text()}})
        monkeypatch.setenv("DAGSTER_HOME", str(home))
        with dg.DagsterInstance.get() as instance:
            yield instance, ns
    finally:
        pg.stop()


def _launch_start_run(instance: Any, spec_path: Path) -> Any:
    """``start_pipeline_run`` of ``spec_path`` launched by the instance's K8sRunLauncher, as the image runs it."""
    from dagster._core.code_pointer import ModuleCodePointer
    from dagster._core.launcher import LaunchRunContext
    from dagster._core.origin import JobPythonOrigin, RepositoryPythonOrigin

    from batch_inference.definitions import defs as project_defs

    origin = JobPythonOrigin("start_pipeline_run", RepositoryPythonOrigin(
        executable_path="/opt/venv/bin/python", code_pointer=ModuleCodePointer("batch_inference.definitions", "defs", None),
        container_image=IMAGE))
    import dagster as dg

    run = instance.create_run_for_job(
        project_defs.resolve_job_def("start_pipeline_run"), job_code_origin=origin, status=dg.DagsterRunStatus.STARTING,
        run_config={"ops": {"start_run": {"config": {"spec_path": str(spec_path)}}}})
    instance.run_launcher.launch_run(LaunchRunContext(dagster_run=run, workspace=None))
    return run


def _run_pods(k8s: K8sCluster, ns: str, run: Any) -> list[Any]:
    pods = client.CoreV1Api(k8s.api_client()).list_namespaced_pod(ns, label_selector=f"dagster/run-id={run.run_id}").items
    return sorted(pods, key=lambda p: p.metadata.creation_timestamp)


def _finished(instance: Any, k8s: K8sCluster, ns: str, run: Any, timeout_s: float) -> Any:
    try:
        return wait_until(lambda: (r := instance.get_run_by_id(run.run_id)).is_finished and r, timeout_s, "the run to finish")
    except AssertionError:
        raise AssertionError("; ".join(f"pod {p.metadata.name} {p.status.phase}: {_container_log(p)}"
                                       for p in _run_pods(k8s, ns, run))) from None


def test_a_run_pod_of_the_image_executes_its_dagster_run(k8s_node: tuple[K8sCluster, RealNode], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Dagster's ``K8sRunLauncher`` with the deploy instance: the run's Job is scheduled on the real
    node, its pod (the project's image, uid 1000, the instance ConfigMap mounted by the kubelet)
    runs ``dagster api execute_run``, loads this project's definitions, executes
    ``start_pipeline_run`` and writes its events to Postgres on the cluster network; the launcher
    follows the Job to its end."""
    import dagster as dg
    from dagster._core.launcher import WorkerStatus

    from batch_inference_tests.defs.helpers import simulated_spec, write_input

    k8s, node = k8s_node
    with _run_instance(k8s, tmp_path, monkeypatch) as (instance, ns):
        spec_path = tmp_path / "spec.yaml"
        spec_path.write_text(yaml.safe_dump(simulated_spec("in-a-real-pod", write_input(tmp_path / "in.jsonl", 40), tmp_path / "runs")))
        run = _launch_start_run(instance, spec_path)
        done = _finished(instance, k8s, ns, run, 240)
        events = [e.dagster_event.event_type_value for e in instance.all_logs(run.run_id) if e.dagster_event]
        assert done.status == dg.DagsterRunStatus.SUCCESS, (events[-5:], [_container_log(p) for p in _run_pods(k8s, ns, run)])
        assert "ASSET_MATERIALIZATION" in events  # source_dataset[in-a-real-pod], written from the pod
        wait_until(lambda: instance.run_launcher.check_run_worker_health(done).status == WorkerStatus.SUCCESS, 60,
                   "the run Job to succeed")
        # a container of the image on the real node, which exited 0 once the run was done
        pod = wait_until(lambda: (p := _run_pods(k8s, ns, run)[0]).status.container_statuses[0].state.terminated and p, 60,
                         "the run pod's container to exit")
        assert pod.spec.node_name == node.name and pod.status.container_statuses[0].image.endswith(IMAGE)
        assert pod.status.container_statuses[0].state.terminated.exit_code == 0
        plan = tmp_path / "runs" / "in-a-real-pod" / "ledger" / "plan.json"  # the start step's plan, written from the pod
        assert plan.exists() and plan.stat().st_uid == 1000
        print(f"RUN POD: {pod.metadata.name} ran {run.run_id[:8]} to {done.status.value}; {len(events)} events in Postgres")


def test_a_sigkilled_run_pod_is_seen_failed_and_its_run_resumes_in_a_new_pod(
        k8s_node: tuple[K8sCluster, RealNode], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run pod's process SIGKILLed mid-step (its machine reclaimed): the Job fails
    (``backoffLimit: 0``), ``check_run_worker_health`` reports it FAILED, which is what run
    monitoring acts on; its resume (``resume_run``, as monitoring calls it up to
    ``max_resume_run_attempts``) runs in a new pod of the image and the run ends SUCCESS."""
    import signal

    import dagster as dg
    from dagster._core.launcher import ResumeRunContext, WorkerStatus

    from batch_inference_tests.defs.helpers import simulated_spec, write_input

    k8s, node = k8s_node
    with _run_instance(k8s, tmp_path, monkeypatch) as (instance, ns):
        spec_path = tmp_path / "spec.yaml"
        spec_path.write_text(yaml.safe_dump(simulated_spec("killed-pod", write_input(tmp_path / "in.jsonl", 40), tmp_path / "runs")))
        run = _launch_start_run(instance, spec_path)

        def step_started() -> bool:
            return any(e.dagster_event and e.dagster_event.event_type_value == "STEP_START" for e in instance.all_logs(run.run_id))

        wait_until(step_started, 240, "the run pod to start its step", poll_s=0.05)
        (pod,) = _run_pods(k8s, ns, run)
        container_id = pod.status.container_statuses[0].container_id.split("//", 1)[1]
        node.ctr("tasks", "kill", "-s", "SIGKILL", container_id)  # the container's process, as a reclaim takes it
        health = wait_until(lambda: (h := instance.run_launcher.check_run_worker_health(instance.get_run_by_id(run.run_id)))
                            .status == WorkerStatus.FAILED and h, 120, "the launcher to see the run worker failed")
        killed = wait_until(lambda: (p := _run_pods(k8s, ns, run)[0]).status.container_statuses[0].state.terminated and p, 60,
                            "the killed container's status")
        assert killed.status.container_statuses[0].state.terminated.exit_code == 128 + signal.SIGKILL, killed.status
        instance.run_launcher.resume_run(ResumeRunContext(dagster_run=instance.get_run_by_id(run.run_id), workspace=None,
                                                          resume_attempt_number=1))
        done = _finished(instance, k8s, ns, run, 240)
        events = [e.dagster_event.event_type_value for e in instance.all_logs(run.run_id) if e.dagster_event]
        assert done.status == dg.DagsterRunStatus.SUCCESS, (events[-8:], [_container_log(p) for p in _run_pods(k8s, ns, run)])
        pods = _run_pods(k8s, ns, run)
        assert len(pods) == 2 and all(p.spec.node_name == node.name for p in pods)
        assert (tmp_path / "runs" / "killed-pod" / "ledger" / "plan.json").exists()
        print(f"RUN POD KILLED: {health.msg!r}; resumed in {pods[1].metadata.name}, run {done.status.value}")
