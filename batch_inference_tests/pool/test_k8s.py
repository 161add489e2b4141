"""Kubernetes launcher: manifests checked against the API models, calls against a fake API."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from batch_inference.cli.pool_cmds import worker
from batch_inference.pool.launchers.k8s import DELETION_COST, K8sLauncher, render_yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
MODELS = {"Secret": "V1Secret", "ConfigMap": "V1ConfigMap", "Deployment": "V1Deployment", "Service": "V1Service"}


def _launcher(**kw: Any) -> K8sLauncher:
    kw.setdefault("image", "ghcr.io/example/batch-inference:0.1.0")
    return K8sLauncher(json.loads((DEPLOY.parent / "engine.json").read_text()), **kw)


def _roundtrip(obj: dict[str, Any]) -> Any:
    api = client.ApiClient()
    model = api._ApiClient__deserialize(obj, MODELS[obj["kind"]])  # the client's own deserialiser
    return model, api.sanitize_for_serialization(model)


def test_manifests_deserialise_into_api_models_without_losing_a_field() -> None:
    for obj in _launcher(storage_secret="creds").render(token="t0k"):
        model, back = _roundtrip(obj)
        assert back == obj, f"{obj['kind']}: a key the API model does not know was dropped"
        assert type(model).__name__ == MODELS[obj["kind"]]


def test_deployment_requests_gpus_probes_health_and_mounts_the_token(tmp_path: Path) -> None:
    objs = {o["kind"]: o for o in _launcher(gpus=2, replicas=3).render(token="t0k")}
    dep, _ = _roundtrip(objs["Deployment"])
    pod = dep.spec.template.spec
    (c,) = pod.containers
    assert dep.spec.replicas == 3
    assert c.resources.requests["nvidia.com/gpu"] == "2" and c.resources.limits["nvidia.com/gpu"] == "2"
    assert c.readiness_probe.http_get.path == "/health" and c.readiness_probe.http_get.port == "http"
    token_volume = next(v for v in pod.volumes if v.name == "token")
    assert token_volume.secret.secret_name == objs["Secret"]["metadata"]["name"]
    assert objs["Secret"]["stringData"]["token"] == "t0k"
    assert any(m.name == "token" and m.mount_path + "/token" in c.args for m in c.volume_mounts)
    assert dep.spec.selector.match_labels == objs["Service"]["spec"]["selector"]
    assert pod.tolerations[0].key == "nvidia.com/gpu"
    assert json.loads(objs["ConfigMap"]["data"]["engine.json"])["kind"] == "vllm"
    # the container args are a valid `batch-inference worker` command line (mounted files stubbed)
    args = list(c.args[1:])
    for flag in ("--engine-config", "--token-file"):
        stub = tmp_path / flag.strip("-")
        stub.write_text("x")
        args[args.index(flag) + 1] = str(stub)
    ctx = worker.make_context("worker", args)
    assert ctx.params["host"] == "0.0.0.0" and ctx.params["storage_roots"] == ("s3://batch-inference",)
    assert ctx.params["concurrency"] == 10 and ctx.params["port"] == 8700


def _judged(**kw: Any) -> tuple[K8sLauncher, K8sLauncher]:
    """The example pair of deploy/k8s/with-judge/worker.yaml: a judge pool on its own model, and the infer pool reaching it."""
    kw.setdefault("storage_roots", ["s3://batch-inference/runs"])
    kw.setdefault("storage_secret", "batch-inference-storage")
    judge = K8sLauncher(json.loads((DEPLOY.parent / "judge-engine.json").read_text()), image="ghcr.io/example/batch-inference:0.1.0",
                        name="batch-inference-worker-judge", **kw)
    return judge, _launcher(judge=judge, **kw)


def test_checked_in_manifests_match_the_renderer() -> None:
    launcher = _launcher(storage_roots=["s3://batch-inference/runs"], storage_secret="batch-inference-storage")
    assert (DEPLOY / "worker.yaml").read_text() == render_yaml(launcher)
    assert (DEPLOY / "with-judge" / "worker.yaml").read_text() == render_yaml(*_judged())
    for name in ("worker.yaml", "with-judge/worker.yaml"):
        for obj in yaml.safe_load_all((DEPLOY / name).read_text()):
            assert _roundtrip(obj)[1] == obj


def _worker_params(container: Any, tmp_path: Path) -> dict[str, Any]:
    """The container's args parsed as a `batch-inference worker` command line (mounted files stubbed)."""
    args = list(container.args[1:])
    for flag in ("--engine-config", "--token-file", "--judge-token-file"):
        if flag in args:
            stub = tmp_path / flag.strip("-")
            stub.write_text("x")
            args[args.index(flag) + 1] = str(stub)
    return worker.make_context("worker", args).params


def test_infer_workers_reach_the_judge_pool_at_its_service_with_its_token(tmp_path: Path) -> None:
    judge, infer = _judged(replicas=3, concurrency=6)
    objs = [o for launcher in (judge, infer) for o in launcher.render(token="t0k")]
    by = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    judge_service = by[("Service", "batch-inference-worker-judge")]
    dep, _ = _roundtrip(by[("Deployment", "batch-inference-worker")])
    pod = dep.spec.template.spec
    (c,) = pod.containers
    params = _worker_params(c, tmp_path)
    # the judge pool's Service (the names of its manifest), and one address for all its workers
    name, ns, port = judge_service["metadata"]["name"], judge_service["metadata"]["namespace"], judge_service["spec"]["ports"][0]["port"]
    assert params["judge_endpoints"] == (f"http://{name}.{ns}.svc.cluster.local:{port}",) == tuple(infer.judge_endpoints())
    assert params["judge_concurrency"] == 3 * 6
    # its token: the judge pool's own Secret, mounted where --judge-token-file reads it
    volume = next(v for v in pod.volumes if v.secret and v.secret.secret_name == "batch-inference-worker-judge-token")
    mount = next(m for m in c.volume_mounts if m.name == volume.name)
    assert c.args[c.args.index("--judge-token-file") + 1] == f"{mount.mount_path}/token"
    assert ("Secret", "batch-inference-worker-judge-token") in by
    # the judge workers themselves judge no tail: no judge of their own
    (jc,) = _roundtrip(by[("Deployment", "batch-inference-worker-judge")])[0].spec.template.spec.containers
    assert "--judge-endpoint" not in jc.args and _worker_params(jc, tmp_path)["judge_endpoints"] == ()
    assert json.loads(by[("ConfigMap", "batch-inference-worker-judge-config")]["data"]["engine.json"])["model"] != json.loads(
        by[("ConfigMap", "batch-inference-worker-config")]["data"]["engine.json"])["model"]
    # the pool without a judge renders no judge flags (worker.yaml stays as it was)
    assert "--judge-endpoint" not in _launcher().render()[2]["spec"]["template"]["spec"]["containers"][0]["args"]


def test_a_judge_pool_needs_its_own_name_in_the_same_namespace() -> None:
    with pytest.raises(ValueError, match="in namespace default, not other"):
        _launcher(namespace="other", judge=_launcher(name="j"))
    with pytest.raises(ValueError, match="its own name"):
        _launcher(judge=_launcher())


def test_the_manifests_command_renders_the_pair_under_the_spec_s_default_names(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from batch_inference.cli.pool_cmds import pool
    from batch_inference.pipeline import PipelineSpec

    out = CliRunner().invoke(pool, ["k8s-manifests", "--engine-config", str(DEPLOY.parent / "engine.json"),
                                    "--judge-engine-config", str(DEPLOY.parent / "judge-engine.json"),
                                    "--image", "ghcr.io/example/batch-inference:0.1.0", "--storage-root", "s3://batch-inference/runs",
                                    "--storage-secret", "batch-inference-storage"])
    assert out.exit_code == 0, out.output
    assert out.output == (DEPLOY / "with-judge" / "worker.yaml").read_text()
    # a spec on these pools (pool.launcher k8s, judge.engine) discovers them by these names
    spec = PipelineSpec.parse({
        "run": "r", "input": str(tmp_path / "in.jsonl"), "output": str(tmp_path / "runs"),
        "engine": {"kind": "simulated"},  # the names do not depend on the models (whose paths a spec checks)
        "judge": {"kind": "llm", "template": "Judge: {result}", "engine": {"kind": "simulated", "seed": 1}},
        "infer": {"template": "Answer: {prompt}"}, "strategy": "in_place", "pool": {"launcher": "k8s", "token_env": "POOL_TOKEN"},
    })
    names = {o["metadata"]["name"] for o in yaml.safe_load_all(out.output) if o["kind"] == "Deployment"}
    assert spec.judge_pool is not None and names == {spec.pool.k8s_name, spec.judge_pool.k8s_name}


class FakeCluster:
    """The subset of AppsV1Api/CoreV1Api the launcher uses, with the API's 404/409 behaviour."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self.ready_ips: list[str] = []
        self.not_ready_ips: list[str] = []
        self.scale_to: list[int] = []
        self.annotations: dict[str, dict[str, str]] = {}

    def _create(self, kind: str, namespace: str, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        self.calls.append((f"create {kind}", name))
        if (kind, name) in self.objects:
            raise ApiException(status=409, reason="AlreadyExists")
        self.objects[(kind, name)] = body

    def _replace(self, kind: str, name: str, namespace: str, body: dict[str, Any]) -> None:
        self.calls.append((f"replace {kind}", name))
        if (kind, name) not in self.objects:
            raise ApiException(status=404, reason="NotFound")
        self.objects[(kind, name)] = body

    def _delete(self, kind: str, name: str, namespace: str) -> None:
        self.calls.append((f"delete {kind}", name))
        if self.objects.pop((kind, name), None) is None:
            raise ApiException(status=404, reason="NotFound")

    def __getattr__(self, attr: str) -> Any:
        verb, _, rest = attr.partition("_namespaced_")
        kind = {"secret": "Secret", "config_map": "ConfigMap", "deployment": "Deployment", "service": "Service"}.get(rest)
        if kind and verb == "create":
            return lambda namespace, body: self._create(kind, namespace, body)
        if kind and verb == "replace":
            return lambda name, namespace, body: self._replace(kind, name, namespace, body)
        if kind and verb == "delete":
            return lambda name, namespace: self._delete(kind, name, namespace)
        raise AttributeError(attr)

    def read_namespaced_secret(self, name: str, namespace: str) -> client.V1Secret:
        obj = self.objects.get(("Secret", name))
        if obj is None:
            raise ApiException(status=404, reason="NotFound")
        data = {k: base64.b64encode(v.encode()).decode() for k, v in obj["stringData"].items()}
        return client.V1Secret(data=data)

    def read_namespaced_endpoints(self, name: str, namespace: str) -> client.V1Endpoints:
        if ("Service", name) not in self.objects:  # the endpoints controller makes them after the Service
            raise ApiException(status=404, reason="NotFound")
        subset = client.V1EndpointSubset(
            addresses=[client.V1EndpointAddress(ip=ip) for ip in self.ready_ips],
            not_ready_addresses=[client.V1EndpointAddress(ip=ip) for ip in self.not_ready_ips],
            ports=[client.CoreV1EndpointPort(name="http", port=8700)],
        )
        return client.V1Endpoints(subsets=[subset])

    def patch_namespaced_deployment_scale(self, name: str, namespace: str, body: dict[str, Any]) -> None:
        self.scale_to.append(body["spec"]["replicas"])

    def patch_namespaced_pod(self, name: str, namespace: str, body: dict[str, Any]) -> None:
        self.annotations[name] = body["metadata"]["annotations"]


def test_up_creates_then_replaces_and_keeps_the_token() -> None:
    fake = FakeCluster()
    fake.ready_ips, fake.not_ready_ips = ["10.0.0.2", "10.0.0.1"], ["10.0.0.9"]
    launcher = _launcher(apps_api=fake, core_api=fake)
    endpoints = launcher.up(wait_s=1, poll_s=0.01)
    assert endpoints == ["http://10.0.0.1:8700", "http://10.0.0.2:8700"]  # ready pods only
    assert [c for c, _ in fake.calls] == ["create Secret", "create ConfigMap", "create Deployment", "create Service"]
    token = launcher.token
    assert token and len(token) > 30 and fake.objects[("Secret", "batch-inference-worker-token")]["stringData"]["token"] == token
    fake.calls.clear()
    again = _launcher(apps_api=fake, core_api=fake, replicas=2)  # a later run, no token in hand
    again.up(wait_s=1, poll_s=0.01)
    assert again.token == token  # clients holding the token stay valid
    assert ("replace Deployment", "batch-inference-worker") in fake.calls
    assert not any(c == "replace Service" for c, _ in fake.calls)  # keeps its clusterIP
    with pytest.raises(TimeoutError, match="2/3 workers ready"):
        _launcher(apps_api=fake, core_api=fake, replicas=3).up(wait_s=0.05, poll_s=0.01)


def test_ttl_scaling_and_down() -> None:
    fake = FakeCluster()
    launcher = _launcher(apps_api=fake, core_api=fake, replicas=3, min_replicas=1, idle_ttl_s=600, scaledown_ttl_s=30)
    assert launcher.apply_ttl({"a": 0.0, "b": 45.0, "c": 90.0}) == 1
    assert fake.annotations == {"b": {DELETION_COST: "-1000"}, "c": {DELETION_COST: "-1000"}} and fake.scale_to == [1]
    assert launcher.apply_ttl({"a": 5.0, "b": 10.0}) == 2 and fake.scale_to == [1]  # nobody idle long enough
    assert launcher.apply_ttl({"a": 700.0, "b": 601.0}) == 0 and fake.scale_to == [1, 0]  # the whole pool idle
    fake.objects[("Deployment", "batch-inference-worker")] = {}
    launcher.down()  # the others are missing: 404s are fine
    assert ("delete Deployment", "batch-inference-worker") in fake.calls and not fake.objects


def test_service_endpoint_and_client() -> None:
    fake = FakeCluster()
    fake.ready_ips = ["10.1.0.5"]
    launcher = _launcher(apps_api=fake, core_api=fake, token="abc", concurrency=7)
    assert launcher.endpoints() == []  # no Service, no Endpoints (404): no ready worker, not an error
    fake.objects[("Service", launcher.name)] = {}
    assert launcher.endpoints(via="service") == ["http://batch-inference-worker.default.svc.cluster.local:8700"]
    pool = launcher.client()
    assert pool.endpoints == ["http://10.1.0.5:8700"] and pool.token == "abc" and pool.limit == 7
