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

import json
import os
import subprocess
import sys
import time
from pathlib import Path
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

    def __init__(self, *args: Any, folder: Path, judge_url: str | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.folder = folder
        self.judge_url = judge_url

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
