"""``K8sLauncher``: the worker pool as a Kubernetes Deployment + Service + Secret.

``render()`` builds the manifests (the checked-in ``deploy/k8s/*.yaml`` are rendered by
it); ``up()`` creates or replaces them through the ``kubernetes`` client and waits for
ready replicas; ``endpoints()`` discovers the ready pods' addresses (one endpoint per
worker, so the client's least-loaded choice and retry-elsewhere work) or the Service;
``scale()``, ``apply_ttl()`` and ``down()`` manage the rest of the lifecycle.

Workers bind 0.0.0.0 inside the pod, so they require the bearer token, which lives in a
Secret mounted as a file. Storage credentials come from the pod's own environment (an
optional Secret via ``envFrom``), never from a task.

A judge with a model of its own runs on a second pool (a launcher of its own, named
``<infer name>-judge`` by the pipeline spec). An infer pool built with ``judge=`` that
launcher renders its workers with ``--judge-endpoint`` at the judge pool's Service (pod
IPs change; the Service name does not), the judge pool's token Secret mounted beside its
own, and ``--judge-concurrency`` at the judge pool's replicas x concurrency, since that
one address stands for every judge worker.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

from batch_inference.engines import EngineConfig
from batch_inference.pool.engine_host import BatcherOptions

log = logging.getLogger(__name__)

TOKEN_MOUNT = "/var/run/secrets/batch-inference"
JUDGE_TOKEN_MOUNT = "/var/run/secrets/batch-inference-judge"
CONFIG_MOUNT = "/etc/batch-inference"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


class K8sLauncher:
    """Render, create, scale, discover and delete a worker pool on Kubernetes."""

    def __init__(
        self,
        engine_config: EngineConfig | dict[str, Any],
        *,
        image: str,
        name: str = "batch-inference-worker",
        namespace: str = "default",
        replicas: int = 2,
        min_replicas: int | None = None,
        concurrency: int = 10,
        port: int = 8700,
        gpus: int = 1,
        cpu: str = "4",
        memory: str = "32Gi",
        storage_roots: list[str] | None = None,
        batcher: BatcherOptions | dict[str, Any] | None = None,
        token: str | None = None,
        storage_secret: str | None = None,
        node_selector: dict[str, str] | None = None,
        tolerations: list[dict[str, Any]] | None = None,
        grace_s: float = 60.0,
        idle_ttl_s: float | None = 600.0,
        scaledown_ttl_s: float | None = None,
        judge: K8sLauncher | None = None,
        apps_api: Any = None,
        core_api: Any = None,
    ) -> None:
        self.engine_config = engine_config if isinstance(engine_config, EngineConfig) else EngineConfig.model_validate(engine_config)
        self.batcher = batcher if isinstance(batcher, BatcherOptions) else BatcherOptions.model_validate(batcher or {})
        self.image = image
        self.name = name
        self.namespace = namespace
        self.replicas = replicas
        self.min_replicas = replicas if min_replicas is None else min_replicas
        self.concurrency = concurrency
        self.port = port
        self.gpus = gpus
        self.cpu = cpu
        self.memory = memory
        self.storage_roots = storage_roots or ["s3://batch-inference"]
        self.token = token
        self.storage_secret = storage_secret
        self.node_selector = node_selector
        self.tolerations = tolerations if tolerations is not None else (
            [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}] if gpus else [])
        self.grace_s = grace_s
        self.idle_ttl_s = idle_ttl_s
        self.scaledown_ttl_s = scaledown_ttl_s
        # the judge's own pool, where these workers' retry tasks judge (its Service and token Secret)
        self.judge = judge
        if judge is not None and judge.namespace != namespace:
            raise ValueError(f"judge pool {judge.name}: in namespace {judge.namespace}, not {namespace} "
                             "(the workers mount its token Secret, which only a pod of its namespace can)")
        if judge is not None and judge.name == name:
            raise ValueError(f"judge pool {judge.name}: the judge needs a pool of its own name (e.g. {name}-judge)")
        self._apps = apps_api
        self._core = core_api
        self._endpoints_seen = False

    # -- manifests ------------------------------------------------------------------

    @property
    def labels(self) -> dict[str, str]:
        return {"app.kubernetes.io/name": "batch-inference-worker", "app.kubernetes.io/instance": self.name}

    def _meta(self, name: str) -> dict[str, Any]:
        return {"name": name, "namespace": self.namespace, "labels": dict(self.labels)}

    def render(self, *, token: str | None = None) -> list[dict[str, Any]]:
        """Secret (token), ConfigMap (engine config), Deployment, Service: plain dicts in apply order."""
        token = token or self.token or "REPLACE-ME-with-a-random-token"
        b = self.batcher
        args = ["worker", "--engine-config", f"{CONFIG_MOUNT}/engine.json", "--host", "0.0.0.0", "--port", str(self.port),
                "--concurrency", str(self.concurrency), "--token-file", f"{TOKEN_MOUNT}/token",
                "--grace-s", f"{self.grace_s:g}", "--target-batch-tokens", str(b.target_batch_tokens),
                "--max-batch-size", str(b.max_batch_size), "--batch-timeout-s", f"{b.batch_timeout_s:g}",
                "--prefetch-batches", str(b.prefetch_batches), "--max-queue-size", str(b.max_queue_size)]
        for root in self.storage_roots:
            args += ["--storage-root", root]
        volume_mounts = [{"name": "token", "mountPath": TOKEN_MOUNT, "readOnly": True},
                         {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True}]
        volumes: list[dict[str, Any]] = [
            {"name": "token", "secret": {"secretName": f"{self.name}-token", "defaultMode": 0o440}},
            {"name": "config", "configMap": {"name": f"{self.name}-config"}}]
        if (judge := self.judge) is not None:
            for endpoint in self.judge_endpoints():
                args += ["--judge-endpoint", endpoint]
            args += ["--judge-token-file", f"{JUDGE_TOKEN_MOUNT}/token",
                     "--judge-concurrency", str(judge.replicas * judge.concurrency)]
            volume_mounts.append({"name": "judge-token", "mountPath": JUDGE_TOKEN_MOUNT, "readOnly": True})
            volumes.append({"name": "judge-token", "secret": {"secretName": f"{judge.name}-token", "defaultMode": 0o440}})
        resources: dict[str, Any] = {"requests": {"cpu": self.cpu, "memory": self.memory},
                                     "limits": {"memory": self.memory}}
        if self.gpus:
            resources["requests"]["nvidia.com/gpu"] = str(self.gpus)
            resources["limits"]["nvidia.com/gpu"] = str(self.gpus)
        container: dict[str, Any] = {
            "name": "worker",
            "image": self.image,
            "command": ["batch-inference"],
            "args": args,
            "ports": [{"name": "http", "containerPort": self.port, "protocol": "TCP"}],
            "resources": resources,
            "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "failureThreshold": 2},
            # model loading can take minutes: the startup probe holds liveness off until then
            "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "failureThreshold": 90},
            "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 20, "failureThreshold": 6},
            "volumeMounts": volume_mounts,
            "securityContext": {"allowPrivilegeEscalation": False},
        }
        if self.storage_secret:
            container["envFrom"] = [{"secretRef": {"name": self.storage_secret}}]
        pod_spec: dict[str, Any] = {
            "containers": [container],
            "terminationGracePeriodSeconds": int(self.grace_s) + 15,
            # fsGroup makes the mounted token readable by the non-root worker (mode 0440)
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000},
            "volumes": volumes,
        }
        if self.node_selector:
            pod_spec["nodeSelector"] = dict(self.node_selector)
        if self.tolerations:
            pod_spec["tolerations"] = [dict(t) for t in self.tolerations]
        return [
            {"apiVersion": "v1", "kind": "Secret", "metadata": self._meta(f"{self.name}-token"),
             "type": "Opaque", "stringData": {"token": token}},
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": self._meta(f"{self.name}-config"),
             "data": {"engine.json": self.engine_config.model_dump_json(indent=2)}},
            {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": self._meta(self.name),
             "spec": {"replicas": self.replicas, "selector": {"matchLabels": dict(self.labels)},
                      "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                      "template": {"metadata": {"labels": dict(self.labels)}, "spec": pod_spec}}},
            {"apiVersion": "v1", "kind": "Service", "metadata": self._meta(self.name),
             "spec": {"type": "ClusterIP", "selector": dict(self.labels),
                      "ports": [{"name": "http", "port": self.port, "targetPort": "http", "protocol": "TCP"}]}},
        ]

    def judge_endpoints(self) -> list[str]:
        """Where these workers reach the judge pool: its Service's DNS name (pod IPs are not
        known when the manifest is rendered, and change as pods are replaced)."""
        return [] if self.judge is None else self.judge.endpoints(via="service")

    # -- cluster calls ------------------------------------------------------------------------

    def _apis(self) -> tuple[Any, Any]:
        if self._apps is None or self._core is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._apps, self._core = client.AppsV1Api(), client.CoreV1Api()
        return self._apps, self._core

    def up(self, *, wait_s: float = 900.0, poll_s: float = 5.0) -> list[str]:
        """Create (or replace) every object, wait for ready replicas; returns the pods' endpoints."""
        from kubernetes.client.exceptions import ApiException

        apps, core = self._apis()
        token = self.token or self._existing_token(core) or secrets.token_urlsafe(32)
        self.token = token
        calls = {
            "Secret": (core.create_namespaced_secret, core.replace_namespaced_secret),
            "ConfigMap": (core.create_namespaced_config_map, core.replace_namespaced_config_map),
            "Deployment": (apps.create_namespaced_deployment, apps.replace_namespaced_deployment),
            "Service": (core.create_namespaced_service, None),  # a Service keeps its clusterIP: never replaced
        }
        for obj in self.render(token=token):
            create, replace = calls[obj["kind"]]
            try:
                create(namespace=self.namespace, body=obj)
                log.info("created %s/%s", obj["kind"], obj["metadata"]["name"])
            except ApiException as exc:
                if exc.status != 409:
                    raise
                if replace is not None:
                    replace(name=obj["metadata"]["name"], namespace=self.namespace, body=obj)
                    log.info("replaced %s/%s", obj["kind"], obj["metadata"]["name"])
        return self.wait_ready(wait_s=wait_s, poll_s=poll_s)

    def _existing_token(self, core: Any) -> str | None:
        """Keep the token of a running pool so clients holding it stay valid."""
        import base64

        from kubernetes.client.exceptions import ApiException

        try:
            secret = core.read_namespaced_secret(name=f"{self.name}-token", namespace=self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        data = getattr(secret, "data", None) or {}
        return base64.b64decode(data["token"]).decode() if "token" in data else None

    def wait_ready(self, *, replicas: int | None = None, wait_s: float = 900.0, poll_s: float = 5.0) -> list[str]:
        want = self.replicas if replicas is None else replicas
        deadline = time.monotonic() + wait_s
        while True:
            endpoints = self.endpoints()
            if len(endpoints) >= want:
                return endpoints
            if time.monotonic() > deadline:
                missing = "" if self._endpoints_seen else (
                    f" (no Endpoints {self.namespace}/{self.name} yet: is the pool's Service deployed?)")
                raise TimeoutError(f"{self.name}: {len(endpoints)}/{want} workers ready after {wait_s:.0f}s{missing}")
            time.sleep(poll_s)

    def endpoints(self, *, via: str = "pods") -> list[str]:
        """Ready workers: one ``http://podIP:port`` each (``via="service"``: the Service's DNS name)."""
        if via == "service":
            return [f"http://{self.name}.{self.namespace}.svc.cluster.local:{self.port}"]
        from kubernetes.client.exceptions import ApiException

        _, core = self._apis()
        try:
            eps = core.read_namespaced_endpoints(name=self.name, namespace=self.namespace)
        except ApiException as exc:
            # The endpoints controller creates a Service's Endpoints a moment after the
            # Service (and deletes them with it): until then no worker is ready, which is
            # not an error (seen on a real API server on first up() and right after down()).
            if exc.status == 404:
                return []
            raise
        self._endpoints_seen = True
        out = []
        for subset in getattr(eps, "subsets", None) or []:
            ports = [p.port for p in (subset.ports or []) if p.name in ("http", None)] or [self.port]
            for address in subset.addresses or []:  # ready addresses only (not_ready_addresses excluded)
                out.append(f"http://{address.ip}:{ports[0]}")
        return sorted(out)

    def status(self) -> dict[str, Any]:
        apps, _ = self._apis()
        dep = apps.read_namespaced_deployment(name=self.name, namespace=self.namespace)
        st = dep.status
        return {"name": self.name, "namespace": self.namespace, "replicas": dep.spec.replicas,
                "ready_replicas": st.ready_replicas or 0, "available_replicas": st.available_replicas or 0,
                "endpoints": self.endpoints()}

    def scale(self, replicas: int) -> None:
        apps, _ = self._apis()
        apps.patch_namespaced_deployment_scale(name=self.name, namespace=self.namespace, body={"spec": {"replicas": replicas}})
        log.info("scaled %s to %d replica(s)", self.name, replicas)

    def apply_ttl(self, idle_by_pod: dict[str, float]) -> int:
        """The ReusePolicy on Kubernetes, from each pod's ``/stats`` ``idle_s``; returns the new replica count.

        Everyone idle past ``idle_ttl_s`` -> scale to 0. Otherwise pods idle past
        ``scaledown_ttl_s`` above ``min_replicas`` are removed: they get the lowest
        pod-deletion-cost, so the Deployment controller deletes exactly those.
        """
        current = len(idle_by_pod)
        if not current:
            return 0
        if self.idle_ttl_s is not None and all(idle >= self.idle_ttl_s for idle in idle_by_pod.values()):
            self.scale(0)
            return 0
        if self.scaledown_ttl_s is None:
            return current
        idle = sorted((p for p, s in idle_by_pod.items() if s >= self.scaledown_ttl_s), key=lambda p: -idle_by_pod[p])
        remove = idle[: max(0, current - self.min_replicas)]
        if not remove:
            return current
        _, core = self._apis()
        for pod in remove:
            core.patch_namespaced_pod(name=pod, namespace=self.namespace,
                                      body={"metadata": {"annotations": {DELETION_COST: "-1000"}}})
        self.scale(current - len(remove))
        return current - len(remove)

    def down(self) -> None:
        """Delete the Deployment, Service, ConfigMap and Secret (missing ones are fine)."""
        from kubernetes.client.exceptions import ApiException

        apps, core = self._apis()
        for delete, name in ((apps.delete_namespaced_deployment, self.name), (core.delete_namespaced_service, self.name),
                             (core.delete_namespaced_config_map, f"{self.name}-config"),
                             (core.delete_namespaced_secret, f"{self.name}-token")):
            try:
                delete(name=name, namespace=self.namespace)
            except ApiException as exc:
                if exc.status != 404:
                    raise

    def client(self, **kwargs: Any) -> Any:
        """A PoolClient over the ready pods, holding the pool's token."""
        from batch_inference.pool.client import PoolClient

        kwargs.setdefault("concurrency", self.concurrency)
        kwargs.setdefault("token", self.token)
        return PoolClient(self.endpoints(), **kwargs)


def render_yaml(*launchers: K8sLauncher) -> str:
    """All manifests of these pools as one multi-document YAML, in order (``deploy/k8s/worker.yaml``
    holds one pool; ``deploy/k8s/with-judge/worker.yaml`` a judge pool, then the infer pool that reaches it)."""
    import yaml

    return "---\n".join(yaml.safe_dump(obj, sort_keys=False) for launcher in launchers for obj in launcher.render())
