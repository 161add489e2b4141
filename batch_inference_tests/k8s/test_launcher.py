"""``K8sLauncher`` and the pipeline's ``pool.launcher: k8s`` on a real API server, with real workers.

In a ``live-`` namespace the node agent runs each pod's command (``batch-inference
worker ...`` with the simulated engine) in a network namespace of its own, with the
pod's Secret (token) and ConfigMap (engine config) mounted where the manifest says; a
pod is Ready only once the worker's ``/health`` answers. So the endpoints the launcher
and the pipeline discover are workers that serve tasks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from kubernetes import client

from batch_inference.pool.launchers.k8s import DELETION_COST, K8sLauncher
from batch_inference_tests.k8s.cluster import K8sCluster
from batch_inference_tests.k8s.helpers import wait_until

pytestmark = [pytest.mark.infra, pytest.mark.slow]
SIMULATED = {"kind": "simulated", "simulated": {"latency_a_s": 0.002, "latency_b_s": 0.0, "approval_rate": 0.6}}
LABELS = "app.kubernetes.io/name=batch-inference-worker"


def _launcher(k8s: K8sCluster, ns: str, roots: list[str], **kw: Any) -> K8sLauncher:
    api = k8s.api_client()
    return K8sLauncher(SIMULATED, image="local/batch-inference:test", namespace=ns, gpus=1, cpu="1", memory="1Gi",
                       storage_roots=roots, apps_api=client.AppsV1Api(api), core_api=client.CoreV1Api(api), **kw)


def _pods(k8s: K8sCluster, ns: str) -> list[Any]:
    return [p for p in client.CoreV1Api(k8s.api_client()).list_namespaced_pod(ns, label_selector=LABELS).items
            if not p.metadata.deletion_timestamp]


def _ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def _worker_stats(k8s: K8sCluster, endpoint: str, token: str) -> dict[str, Any]:
    """GET /stats of a pod's worker from inside the cluster network (the test process cannot route there)."""
    code = ("import sys, urllib.request; r = urllib.request.Request(sys.argv[1] + '/stats', "
            "headers={'Authorization': 'Bearer ' + sys.argv[2]}); print(urllib.request.urlopen(r, timeout=10).read().decode())")
    out = subprocess.run(k8s.in_netns([sys.executable, "-c", code, endpoint, token]), capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(out.stdout)


def test_up_scale_status_ttl_down_and_the_endpoints_404_race(k8s: K8sCluster, namespace, tmp_path: Path) -> None:
    ns = namespace(live=True)
    launcher = _launcher(k8s, ns, [str(tmp_path)], replicas=2, min_replicas=1, idle_ttl_s=600, scaledown_ttl_s=30)
    # No Service yet, so no Endpoints object (404): "no ready workers", not an error, here and
    # in up() while the endpoints controller has not yet created the new Service's Endpoints.
    assert launcher.endpoints() == []
    with pytest.raises(TimeoutError, match=r"0/2 workers ready .*no Endpoints"):
        launcher.wait_ready(wait_s=0.5, poll_s=0.1)

    endpoints = launcher.up(wait_s=180, poll_s=0.3)
    assert len(endpoints) == 2 and all(e.startswith("http://10.244.0.") and e.endswith(":8700") for e in endpoints)
    # up() returns on the Service's Endpoints; the Deployment's status.readyReplicas is written by
    # another controller and may trail them by a sync (a fresh-clone run saw 1 here)
    wait_until(lambda: launcher.status()["ready_replicas"] == 2, 60, "the Deployment's readyReplicas to reach 2")
    status = launcher.status()
    assert status["ready_replicas"] == 2 and status["endpoints"] == endpoints
    for endpoint in endpoints:  # real workers, holding the token from the pool's Secret, the engine from its ConfigMap
        stats = _worker_stats(k8s, endpoint, launcher.token or "")
        assert stats["worker"].startswith(f"{launcher.name}-") and stats["engine"].startswith("simulated"), stats

    launcher.scale(5)  # 5 x 1 GPU on a 4-GPU node: four run, the fifth waits, unschedulable
    wait_until(lambda: sum(_ready(p) for p in _pods(k8s, ns)) == 4 and any(
        c.reason == "Unschedulable" for p in _pods(k8s, ns) for c in p.status.conditions or []), 180, "4 ready + 1 pending")
    assert len(launcher.wait_ready(replicas=4, wait_s=30, poll_s=0.3)) == 4
    assert launcher.status()["replicas"] == 5 and launcher.status()["ready_replicas"] == 4
    launcher.scale(4)
    wait_until(lambda: len(_pods(k8s, ns)) == 4, 60, "the pending pod to go")

    # TTL: two pods idle past scaledown_ttl_s are marked cheapest to delete and the Deployment shrinks
    names = sorted(p.metadata.name for p in _pods(k8s, ns))
    idle = {names[0]: 90.0, names[1]: 45.0, names[2]: 1.0, names[3]: 0.0}
    assert launcher.apply_ttl(idle) == 2
    for name in names[:2]:
        pod = client.CoreV1Api(k8s.api_client()).read_namespaced_pod(name, ns)
        assert pod.metadata.annotations[DELETION_COST] == "-1000"
    wait_until(lambda: len(_pods(k8s, ns)) == 2 and len(launcher.endpoints()) == 2, 90, "2 replicas left")
    kept = sorted(p.metadata.name for p in _pods(k8s, ns))
    print(f"K8S TTL on 1.20: asked to remove {names[:2]}, the ReplicaSet controller kept {kept} "
          f"(pod-deletion-cost is honoured from 1.21/1.22 only)")
    assert launcher.apply_ttl({name: 700.0 for name in kept}) == 0  # the whole pool idle past idle_ttl_s
    wait_until(lambda: not _pods(k8s, ns) and not launcher.endpoints(), 90, "scale to zero")

    launcher.down()
    assert launcher.endpoints() == []  # the Service and its Endpoints are gone: 404 again, still no error
    # up() right after down(): the new Service's Endpoints may not exist yet (the race seen on real servers)
    again = _launcher(k8s, ns, [str(tmp_path)], replicas=1)
    assert len(again.up(wait_s=180, poll_s=0.2)) == 1
    again.down()


def test_the_pipeline_discovers_the_pods_through_the_api_and_runs_on_them(k8s: K8sCluster, namespace, tmp_path: Path) -> None:
    ns = namespace(live=True)
    launcher = _launcher(k8s, ns, [str(tmp_path)], replicas=2, concurrency=2)
    endpoints = launcher.up(wait_s=180, poll_s=0.3)
    # RBAC: the pipeline's identity may read this namespace's Endpoints and nothing else
    rbac = client.RbacAuthorizationV1Api(k8s.api_client())
    rbac.create_namespaced_role(ns, {"metadata": {"name": "pool-discovery"}, "rules": [
        {"apiGroups": [""], "resources": ["endpoints"], "verbs": ["get"]}]})
    rbac.create_namespaced_role_binding(ns, {"metadata": {"name": "pool-discovery"},
                                             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pool-discovery"},
                                             "subjects": [{"kind": "User", "name": "pipeline", "apiGroup": "rbac.authorization.k8s.io"}]})
    ids = [f"k{i:04d}" for i in range(300)]
    (tmp_path / "input.jsonl").write_bytes(b"".join(orjson.dumps({"id": i, "prompt": f"question {i}"}) + b"\n" for i in ids))
    spec = {"run": "on-k8s", "input": str(tmp_path / "input.jsonl"), "output": str(tmp_path / "out"), "engine": SIMULATED,
            "infer": {"template": "{prompt}", "sampling": {"max_tokens": 8, "temperature": 1.0, "seed": 1}},
            "judge": {"kind": "rule", "callable": "regex", "kwargs": {"pattern": "^APPROVED"}},
            "strategy": "rounds", "max_rounds": 3, "shard_records": 25, "chunk_size": 25,
            "pool": {"launcher": "k8s", "k8s_name": launcher.name, "namespace": ns, "token_env": "POOL_TOKEN",
                     "replicas": 2, "concurrency": 2, "ready_timeout_s": 60, "retries": 1}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    env = {**os.environ, "KUBECONFIG": str(k8s.kubeconfig_file("pipeline", inside=True)), "POOL_TOKEN": launcher.token or ""}
    cli = str(Path(sys.executable).parent / "batch-inference")
    # the driver runs where a Dagster run pod would: on the cluster network, reaching the API and the pods
    run = subprocess.run(k8s.in_netns([cli, "run", str(tmp_path / "spec.yaml")]), env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode in (0, 3), run.stdout[-3000:] + run.stderr[-3000:]
    summary = orjson.loads((tmp_path / "out" / "on-k8s" / "ledger" / "run.json").read_bytes())
    assert summary["conservation"]["ok"] and summary["records"] == 300, summary
    served = {e: _worker_stats(k8s, e, launcher.token or "")["tasks_completed"] for e in endpoints}
    assert all(n > 0 for n in served.values()) and sum(served.values()) >= 24, served  # 12 shards x (infer + judge)
    # the same user cannot list pods: RBAC really is on
    denied = k8s.kubectl("get", "pods", "-n", ns, user="pipeline", check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr
    launcher.down()
