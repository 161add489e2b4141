"""A test-only node agent: the part of a kubelet (and of the scheduler) the tests need.

No kubelet exists in these registries, so this process stands in for one node:

- registers a Node with ``nvidia.com/gpu`` capacity and keeps its Ready condition fresh
  (the node lifecycle controller would otherwise mark it NotReady and evict);
- binds unscheduled pods to the node when their GPU requests fit what is free (a
  one-node scheduler: a pod that does not fit stays Pending);
- for pods in namespaces starting with a ``--run-namespace-prefix``, runs the first container's command and
  args as a local process (``pod_exec.py``) in a network namespace of its own, with its
  own address on the cluster bridge, its Secret/ConfigMap volumes mounted at their paths
  and its env; the pod turns Ready when its HTTP readiness probe answers, so the
  endpoints controller publishes exactly the workers that serve; a container that exits
  is restarted (``restartPolicy: Always``) or ends the pod Succeeded/Failed;
- pods in other namespaces are only reported Running and Ready (no process: their
  image, e.g. vLLM on a GPU, cannot run here); the annotation
  ``batch-inference.test/exit-code: "N"`` ends such a pod's container with code N (the
  test plays the container's part: Succeeded for 0, else Failed);
- deleting a pod stops its process (SIGTERM, then SIGKILL after the grace period, capped
  at 10 s), removes its namespace and finishes the deletion.

What it does not do: pull or run images (the container's command runs in this
machine's environment, the test venv first on PATH), run as ``runAsUser``, enforce
resource limits, liveness/startup probes, or schedule on anything but GPUs.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

log = logging.getLogger("node-agent")
GPU = "nvidia.com/gpu"
EXIT_CODE = "batch-inference.test/exit-code"
GATEWAY = "10.244.0.1"
POD_PREFIX = "10.244.0."


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def gpus_of(pod: Any) -> int:
    total = 0
    for c in pod.spec.containers:
        requests = (c.resources.requests if c.resources else None) or {}
        limits = (c.resources.limits if c.resources else None) or {}
        total += int(requests.get(GPU) or limits.get(GPU) or 0)
    return total


@dataclass
class LocalPod:
    uid: str
    namespace: str
    name: str
    ip: str
    netns: str | None = None
    dir: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    runnable: bool = False
    ready: bool = False
    restarts: int = 0
    started_at: str = field(default_factory=now)
    next_probe: float = 0.0
    restart_at: float | None = None
    phase: str = "Running"
    exit_code: int | None = None
    deleting_since: float | None = None
    reported: str = ""


class NodeAgent:
    def __init__(self, api: client.ApiClient, *, node: str, gpus: int, netns_prefix: str, run_prefixes: tuple[str, ...],
                 workdir: Path, bin_path: str) -> None:
        self.core = client.CoreV1Api(api)
        self.node, self.gpus = node, gpus
        self.netns_prefix = netns_prefix
        self.run_prefixes = run_prefixes
        self.workdir = workdir
        self.bin_path = bin_path
        self.pods: dict[str, LocalPod] = {}
        self.free_ips = [f"{POD_PREFIX}{i}" for i in range(2, 250)]
        self._beat = 0.0

    # -- the node ---------------------------------------------------------------------

    def _conditions(self) -> list[dict[str, Any]]:
        t = now()
        ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test node agent",
                 "lastHeartbeatTime": t, "lastTransitionTime": t}
        healthy = [{"type": kind, "status": "False", "reason": "KubeletHasSufficient", "lastHeartbeatTime": t,
                    "lastTransitionTime": t} for kind in ("MemoryPressure", "DiskPressure", "PIDPressure")]
        return [ready, *healthy]

    def register(self) -> None:
        capacity = {"cpu": "64", "memory": "512Gi", "pods": "110", GPU: str(self.gpus)}
        body = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": self.node, "labels": {"kubernetes.io/hostname": self.node, "kubernetes.io/os": "linux",
                                                           "nvidia.com/gpu.present": "true"}}}
        try:
            self.core.create_node(body)
        except ApiException as exc:
            if exc.status != 409:
                raise
        self.core.patch_node_status(self.node, {"status": {
            "capacity": capacity, "allocatable": capacity, "conditions": self._conditions(),
            "addresses": [{"type": "InternalIP", "address": GATEWAY}, {"type": "Hostname", "address": self.node}],
            "nodeInfo": {"kubeletVersion": "v1.20.2-test-agent", "kubeProxyVersion": "", "operatingSystem": "linux",
                         "architecture": "amd64", "containerRuntimeVersion": "local-process://0", "machineID": "",
                         "systemUUID": "", "bootID": "", "kernelVersion": os.uname().release, "osImage": "test"},
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}}}})
        self._beat = time.monotonic()
        log.info("registered node %s with %d GPUs", self.node, self.gpus)

    def heartbeat(self) -> None:
        if time.monotonic() - self._beat >= 5:
            self.core.patch_node_status(self.node, {"status": {"conditions": self._conditions()}})
            self._beat = time.monotonic()

    # -- scheduling -------------------------------------------------------------------

    def schedule(self, pods: list[Any]) -> None:
        used = sum(gpus_of(p) for p in pods if p.spec.node_name == self.node and p.status.phase not in ("Succeeded", "Failed"))
        for pod in sorted(pods, key=lambda p: p.metadata.creation_timestamp):
            if pod.spec.node_name or pod.metadata.deletion_timestamp or pod.status.phase != "Pending":
                continue
            need = gpus_of(pod)
            if used + need > self.gpus:
                self._unschedulable(pod, f"0/1 nodes are available: 1 Insufficient {GPU}.")
                continue
            body = client.V1Binding(metadata=client.V1ObjectMeta(name=pod.metadata.name),
                                    target=client.V1ObjectReference(api_version="v1", kind="Node", name=self.node))
            try:
                self.core.create_namespaced_pod_binding(pod.metadata.name, pod.metadata.namespace, body, _preload_content=False)
            except ApiException as exc:
                if exc.status in (404, 409):
                    continue
                raise
            used += need
            log.info("bound %s/%s (%d GPU)", pod.metadata.namespace, pod.metadata.name, need)

    def _unschedulable(self, pod: Any, message: str) -> None:
        conditions = pod.status.conditions or []
        if any(c.type == "PodScheduled" and c.reason == "Unschedulable" for c in conditions):
            return
        self.core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, {"status": {"conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message,
             "lastTransitionTime": now()}]}})

    # -- pods on this node ------------------------------------------------------------------

    def sync(self, pods: list[Any]) -> None:
        mine = {p.metadata.uid: p for p in pods if p.spec.node_name == self.node}
        for uid in list(self.pods):
            if uid not in mine:  # deleted by someone with grace 0, or gone
                self._teardown(self.pods.pop(uid))
        for uid, pod in mine.items():
            local = self.pods.get(uid)
            if local is None:
                if pod.metadata.deletion_timestamp or pod.status.phase in ("Succeeded", "Failed"):
                    continue
                local = self.pods[uid] = self._start(pod)
            if pod.metadata.deletion_timestamp:
                self._delete(pod, local)
                continue
            self._watch(pod, local)
            self._report(pod, local)

    def _start(self, pod: Any) -> LocalPod:
        local = LocalPod(pod.metadata.uid, pod.metadata.namespace, pod.metadata.name, self.free_ips.pop(0))
        c = pod.spec.containers[0]
        local.runnable = pod.metadata.namespace.startswith(self.run_prefixes) and bool(c.command or c.args)
        if not local.runnable:
            local.ready = True
            return local
        n = local.ip.rsplit(".", 1)[1]
        local.netns = f"{self.netns_prefix}-p{n}"
        local.dir = self.workdir / "pods" / local.uid
        local.dir.mkdir(parents=True)
        sh("ip", "netns", "add", local.netns)
        sh("ip", "link", "add", f"veth{n}", "type", "veth", "peer", "name", "eth0", "netns", local.netns)
        sh("ip", "link", "set", f"veth{n}", "master", "br0", "up")
        sh("ip", "-n", local.netns, "addr", "add", f"{local.ip}/24", "dev", "eth0")
        sh("ip", "-n", local.netns, "link", "set", "eth0", "up")
        sh("ip", "-n", local.netns, "link", "set", "lo", "up")
        sh("ip", "-n", local.netns, "route", "add", "default", "via", GATEWAY)
        self._spawn(pod, local)
        return local

    def _volumes(self, pod: Any, local: LocalPod) -> list[dict[str, Any]]:
        assert local.dir is not None
        sources: dict[str, Path] = {}
        for v in pod.spec.volumes or []:
            path = local.dir / "volumes" / v.name
            path.mkdir(parents=True, exist_ok=True)
            if v.secret is not None:
                secret = self.core.read_namespaced_secret(v.secret.secret_name, local.namespace)
                files = {k: base64.b64decode(val) for k, val in (secret.data or {}).items()}
                mode = v.secret.default_mode
            elif v.config_map is not None:
                cm = self.core.read_namespaced_config_map(v.config_map.name, local.namespace)
                files = {k: val.encode() for k, val in (cm.data or {}).items()}
                mode = v.config_map.default_mode
            else:  # emptyDir and anything else: an empty directory
                files, mode = {}, None
            for key, data in files.items():
                (path / key).write_bytes(data)
                if mode is not None:
                    (path / key).chmod(mode)
            sources[v.name] = path
        c = pod.spec.containers[0]
        return [{"source": str(sources[m.name]), "mountPath": m.mount_path, "readOnly": bool(m.read_only)}
                for m in c.volume_mounts or [] if m.name in sources]

    def _env(self, pod: Any) -> dict[str, str]:
        c = pod.spec.containers[0]
        env = {"PATH": f"{self.bin_path}:/usr/local/bin:/usr/bin:/bin", "HOSTNAME": pod.metadata.name, "HOME": "/root",
               "KUBERNETES_SERVICE_HOST": GATEWAY, "KUBERNETES_SERVICE_PORT": "6443"}
        for source in c.env_from or []:
            ref = source.secret_ref or source.config_map_ref
            try:
                if source.secret_ref is not None:
                    data = {k: base64.b64decode(v).decode() for k, v in (self.core.read_namespaced_secret(
                        ref.name, pod.metadata.namespace).data or {}).items()}
                else:
                    data = dict(self.core.read_namespaced_config_map(ref.name, pod.metadata.namespace).data or {})
            except ApiException as exc:
                if exc.status == 404 and ref.optional:
                    continue
                raise
            env.update({f"{source.prefix or ''}{k}": v for k, v in data.items()})
        for var in c.env or []:
            if var.value is not None:
                env[var.name] = var.value
            elif var.value_from is not None and var.value_from.secret_key_ref is not None:
                ref = var.value_from.secret_key_ref
                data = self.core.read_namespaced_secret(ref.name, pod.metadata.namespace).data or {}
                env[var.name] = base64.b64decode(data[ref.key]).decode()
        return env

    def _spawn(self, pod: Any, local: LocalPod) -> None:
        assert local.dir is not None and local.netns is not None
        c = pod.spec.containers[0]
        scratch = local.dir / f"scratch-{local.restarts}"
        # no image: an unset command means an image without an ENTRYPOINT (args run as they are)
        spec = {"argv": [*(c.command or []), *(c.args or [])], "env": self._env(pod), "workingDir": c.working_dir,
                "mounts": self._volumes(pod, local), "scratch": str(scratch), "hostname": pod.metadata.name[:63]}
        (local.dir / "spec.json").write_text(json.dumps(spec))
        logfile = (local.dir / "container.log").open("ab")
        local.proc = subprocess.Popen(
            ["ip", "netns", "exec", local.netns, "unshare", "--mount", "--uts", "--propagation", "private",
             sys.executable, "-m", "batch_inference_tests.k8s.pod_exec", str(local.dir / "spec.json")],
            stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        logfile.close()
        local.started_at = now()
        local.ready = False
        log.info("started %s/%s at %s: %s (pid %d)", local.namespace, local.name, local.ip, spec["argv"][:3], local.proc.pid)

    def _probe(self, pod: Any, local: LocalPod) -> bool:
        c = pod.spec.containers[0]
        probe = c.readiness_probe
        if probe is None or probe.http_get is None:
            return True
        port = probe.http_get.port
        if isinstance(port, str) and not port.isdigit():
            port = next(p.container_port for p in c.ports or [] if p.name == port)
        try:
            with urllib.request.urlopen(f"http://{local.ip}:{port}{probe.http_get.path or '/'}", timeout=1) as resp:
                return 200 <= resp.status < 400
        except OSError:
            return False

    def _watch(self, pod: Any, local: LocalPod) -> None:
        if local.phase != "Running":
            return
        if not local.runnable:
            code = (pod.metadata.annotations or {}).get(EXIT_CODE)
            if code is not None:
                local.exit_code, local.ready = int(code), False
                local.phase = "Succeeded" if local.exit_code == 0 else "Failed"
            return
        if local.proc is not None and local.proc.poll() is not None:
            local.exit_code, local.proc, local.ready = local.proc.returncode, None, False
            policy = pod.spec.restart_policy or "Always"
            if policy == "Always" or (policy == "OnFailure" and local.exit_code != 0):
                local.restart_at = time.monotonic() + 1.0
                log.info("%s/%s exited %d: restarting", local.namespace, local.name, local.exit_code)
            else:
                local.phase = "Succeeded" if local.exit_code == 0 else "Failed"
                log.info("%s/%s exited %d: %s", local.namespace, local.name, local.exit_code, local.phase)
                return
        if local.proc is None and local.restart_at is not None and time.monotonic() >= local.restart_at:
            local.restarts += 1
            local.restart_at = None
            self._spawn(pod, local)
        if local.proc is not None and time.monotonic() >= local.next_probe:
            period = min(float((pod.spec.containers[0].readiness_probe or client.V1Probe()).period_seconds or 1), 1.0)
            local.next_probe = time.monotonic() + period
            local.ready = self._probe(pod, local)

    def _report(self, pod: Any, local: LocalPod) -> None:
        c = pod.spec.containers[0]
        ready = "True" if local.ready and local.phase == "Running" else "False"
        if local.phase == "Running" and local.proc is None and local.runnable:
            state: dict[str, Any] = {"waiting": {"reason": "CrashLoopBackOff"}}
        elif local.phase == "Running":
            state = {"running": {"startedAt": local.started_at}}
        else:
            state = {"terminated": {"exitCode": local.exit_code or 0, "reason": "Completed" if local.exit_code == 0 else "Error",
                                    "startedAt": local.started_at, "finishedAt": now()}}
        status = {"phase": local.phase, "podIP": local.ip, "podIPs": [{"ip": local.ip}], "hostIP": GATEWAY,
                  "startTime": pod.status.start_time.strftime("%Y-%m-%dT%H:%M:%SZ") if pod.status.start_time else local.started_at,
                  "conditions": [{"type": t, "status": s, "lastTransitionTime": None} for t, s in (
                      ("PodScheduled", "True"), ("Initialized", "True"), ("ContainersReady", ready), ("Ready", ready))],
                  "containerStatuses": [{"name": c.name, "image": c.image, "imageID": "", "ready": ready == "True",
                                         "restartCount": local.restarts, "started": local.proc is not None or not local.runnable,
                                         "state": state}]}
        key = json.dumps(status, sort_keys=True, default=str)
        if key == local.reported:
            return
        for cond in status["conditions"]:
            cond["lastTransitionTime"] = now()
        try:
            self.core.patch_namespaced_pod_status(local.name, local.namespace, {"status": status})
            local.reported = key
        except ApiException as exc:
            if exc.status != 404:
                raise

    def _delete(self, pod: Any, local: LocalPod) -> None:
        if local.deleting_since is None:
            local.deleting_since = time.monotonic()
            if local.proc is not None and local.proc.poll() is None:
                os.kill(local.proc.pid, signal.SIGTERM)
        grace = min(float(pod.metadata.deletion_grace_period_seconds or 0), 10.0)
        alive = local.proc is not None and local.proc.poll() is None
        if alive and time.monotonic() - local.deleting_since < grace:
            return
        self._teardown(self.pods.pop(local.uid))
        try:
            self.core.delete_namespaced_pod(local.name, local.namespace, grace_period_seconds=0,
                                            body=client.V1DeleteOptions(grace_period_seconds=0,
                                                                        preconditions=client.V1Preconditions(uid=local.uid)))
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise
        log.info("deleted %s/%s", local.namespace, local.name)

    def _teardown(self, local: LocalPod) -> None:
        if local.proc is not None and local.proc.poll() is None:
            local.proc.kill()
        if local.proc is not None:
            local.proc.wait(timeout=10)
        if local.netns:
            subprocess.run(["ip", "netns", "del", local.netns], capture_output=True, timeout=30)
        if local.dir is not None:
            shutil.rmtree(local.dir, ignore_errors=True)
        self.free_ips.append(local.ip)

    def close(self) -> None:
        for uid in list(self.pods):
            self._teardown(self.pods.pop(uid))

    def run(self, stop: list[bool]) -> None:
        self.register()
        while not stop:
            try:
                pods = self.core.list_pod_for_all_namespaces().items
                self.schedule(pods)
                self.sync(pods)
                self.heartbeat()
            except Exception:  # an API hiccup must not kill the node: log and go on
                log.exception("sync failed")
            time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--node", default="gpu-node-0")
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--netns-prefix", required=True)
    parser.add_argument("--run-namespace-prefix", action="append", default=[])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--bin-path", default=str(Path(sys.executable).parent))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    api = config.new_client_from_config(args.kubeconfig)
    agent = NodeAgent(api, node=args.node, gpus=args.gpus, netns_prefix=args.netns_prefix,
                      run_prefixes=tuple(args.run_namespace_prefix), workdir=Path(args.workdir), bin_path=args.bin_path)
    stop: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    try:
        agent.run(stop)
    finally:
        agent.close()


if __name__ == "__main__":
    main()
