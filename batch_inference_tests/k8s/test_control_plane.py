"""The manifests and the launcher against a real kube-apiserver + kube-controller-manager 1.20.2.

Objects are validated and stored by the real API server (token auth, RBAC), rolled out
by the real Deployment/ReplicaSet/endpoints controllers; the node agent binds the pods
and reports them (``k8s/node_agent.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from batch_inference.pool.launchers.k8s import K8sLauncher
from batch_inference_tests.k8s.cluster import K8sCluster

pytestmark = pytest.mark.infra
ROOT = Path(__file__).resolve().parents[2]
SIMULATED = {"kind": "simulated", "simulated": {"latency_a_s": 0.001, "latency_b_s": 0.0}}


def _create(k8s: K8sCluster, obj: dict[str, Any]) -> None:
    api = client.ApiClient(k8s.api_client().configuration)
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    ns = obj["metadata"]["namespace"]
    create = {"Secret": core.create_namespaced_secret, "ConfigMap": core.create_namespaced_config_map,
              "Deployment": apps.create_namespaced_deployment, "Service": core.create_namespaced_service,
              "Endpoints": core.create_namespaced_endpoints}[obj["kind"]]
    create(namespace=ns, body=obj)


def _rejected(k8s: K8sCluster, obj: dict[str, Any]) -> str:
    with pytest.raises(ApiException) as info:
        _create(k8s, obj)
    assert info.value.status == 422, info.value.body
    return json.loads(info.value.body)["message"]


def test_kubectl_apply_of_deploy_k8s_is_accepted_and_rolled_out(k8s: K8sCluster) -> None:
    applied = k8s.kubectl("apply", "-f", str(ROOT / "deploy" / "k8s"))  # the whole directory, as the docs say
    assert "deployment.apps/batch-inference-worker created" in applied.stdout, applied.stdout
    try:
        k8s.kubectl("rollout", "status", "deployment/batch-inference-worker", "--timeout=90s", timeout=120)
        endpoints = json.loads(k8s.kubectl("get", "endpoints", "batch-inference-worker", "-o", "json").stdout)
        ips = [a["ip"] for s in endpoints["subsets"] for a in s["addresses"]]
        assert len(ips) == 2 and all(ip.startswith("10.244.0.") for ip in ips), ips
        pods = json.loads(k8s.kubectl("get", "pods", "-l", "app.kubernetes.io/name=batch-inference-worker", "-o", "json").stdout)
        for pod in pods["items"]:  # the GPU request reached the pods and the node's capacity accounts for it
            (c,) = pod["spec"]["containers"]
            assert c["resources"]["limits"]["nvidia.com/gpu"] == "1" and pod["spec"]["nodeName"] == "gpu-node-0"
        # a second apply of the same files changes nothing
        again = k8s.kubectl("apply", "-f", str(ROOT / "deploy" / "k8s"))
        assert "deployment.apps/batch-inference-worker unchanged" in again.stdout, again.stdout
    finally:
        k8s.kubectl("delete", "-f", str(ROOT / "deploy" / "k8s"), "--wait=true", "--timeout=60s", timeout=90)


def test_invalid_manifests_are_rejected_by_the_server(k8s: K8sCluster, namespace) -> None:
    ns = namespace()
    objs = {o["kind"]: o for o in K8sLauncher(SIMULATED, image="local/test", namespace=ns).render(token="t")}
    dep = json.loads(json.dumps(objs["Deployment"]))
    dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "2"
    assert "must be equal to nvidia.com/gpu limit" in _rejected(k8s, dep)  # extended resources: request == limit
    dep = json.loads(json.dumps(objs["Deployment"]))
    dep["spec"]["template"]["metadata"]["labels"] = {"app": "other"}
    assert "`selector` does not match template `labels`" in _rejected(k8s, dep)
    bad = {o["kind"]: o for o in K8sLauncher(SIMULATED, image="local/test", name="Batch_Workers", namespace=ns).render(token="t")}
    assert "a lowercase RFC 1123 subdomain" in _rejected(k8s, bad["Secret"])
    # Endpoints may not point at loopback: why the node agent gives pods addresses of their own
    loopback = {"apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": "lo", "namespace": ns},
                "subsets": [{"addresses": [{"ip": "127.0.0.1"}], "ports": [{"name": "http", "port": 8700}]}]}
    assert "may not be in the loopback range" in _rejected(k8s, loopback)
    # kubectl's schema validation refuses unknown fields before anything reaches the server
    typo = json.loads(json.dumps(objs["Service"]))
    typo["spec"]["selectr"] = typo["spec"]["selector"]
    out = k8s.kubectl("apply", "-f", "-", stdin=json.dumps(typo), check=False)
    assert out.returncode != 0 and 'unknown field "selectr"' in out.stderr, out.stderr
    for o in objs.values():  # and the rendered manifests themselves are accepted as they are
        _create(k8s, o)


def test_ttl_seconds_after_finished_is_dropped_by_1_20(k8s: K8sCluster, namespace) -> None:
    """What 1.20 lacks: ``ttlSecondsAfterFinished`` is alpha (feature gate off), silently dropped."""
    ns = namespace()
    batch = client.BatchV1Api(k8s.api_client())
    job = batch.create_namespaced_job(ns, {"metadata": {"name": "ttl"}, "spec": {"ttlSecondsAfterFinished": 60, "template": {
        "spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "x", "command": ["true"]}]}}}})
    assert job.spec.ttl_seconds_after_finished is None
