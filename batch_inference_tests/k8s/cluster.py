"""A real Kubernetes 1.20.2 control plane for the tests: etcd, kube-apiserver, kube-controller-manager.

The binaries come from ``.ci/build_k8s.sh`` (Debian's source package, cached under
``~/.cache/batch_inference/kubernetes-1.20.2``) and Debian's ``etcd-server``. Token
authentication and RBAC are on; anonymous requests are refused.

Everything runs inside one network namespace the cluster creates (``bi-k8s-<id>``) with
a bridge at ``10.244.0.1``: the API server advertises that address (Endpoints refuse
loopback addresses), pods get their own namespaces and addresses on the bridge from the
node agent (``node_agent.py``), and processes started in the cluster namespace (a
pipeline driver) reach both. The test process reaches the API server through one
forwarded port on 127.0.0.1 (``forward.py``). Nothing is routed outside these namespaces.

The ``k8s`` fixture's cluster has no kubelet, kube-scheduler or kube-proxy:
``node_agent.py`` stands in for the first two. The ``k8s_node`` fixture's cluster has a
real node instead (``node.py``: kubelet, containerd + runc, kube-scheduler, kube-proxy).
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from batch_inference_tests.fixtures.infra import CACHE, stop_pid

K8S_VERSION = "1.20.2"
K8S_BIN = CACHE / f"kubernetes-{K8S_VERSION}" / "bin"
GATEWAY = "10.244.0.1"  # the bridge in the cluster namespace: the API server's advertised address
POD_PREFIX = "10.244.0."
SERVICE_CIDR = "10.96.0.0/16"  # allocated by the API server only: no proxy, nothing listens there
API_PORT = 6443


def binaries_missing() -> list[str]:
    missing = [str(K8S_BIN / b) for b in ("kube-apiserver", "kube-controller-manager", "kubectl") if not (K8S_BIN / b).exists()]
    missing += [b for b in ("etcd", "ip", "unshare") if shutil.which(b) is None]
    return missing


def sh(*argv: str, timeout: float = 30) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=timeout).stdout


def _certificates(root: Path) -> None:
    """A CA, the API server's serving certificate and the service-account signing key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    def key() -> rsa.RSAPrivateKey:
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def write_key(k: rsa.RSAPrivateKey, name: str) -> None:
        (root / name).write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                                  serialization.NoEncryption()))

    now = dt.datetime.now(dt.timezone.utc)
    ca_key, api_key, sa_key = key(), key(), key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "batch-inference-test-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=2)).add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
          .sign(ca_key, hashes.SHA256()))
    sans = [x509.DNSName(n) for n in ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                                      "kubernetes.default.svc.cluster.local")]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", GATEWAY, "10.96.0.1")]
    api = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
           .issuer_name(ca_name).public_key(api_key.public_key()).serial_number(x509.random_serial_number())
           .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=2))
           .add_extension(x509.SubjectAlternativeName(sans), False).sign(ca_key, hashes.SHA256()))
    (root / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (root / "apiserver.crt").write_bytes(api.public_bytes(serialization.Encoding.PEM))
    write_key(ca_key, "ca.key")
    write_key(api_key, "apiserver.key")
    write_key(sa_key, "sa.key")
    (root / "sa.pub").write_bytes(sa_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                                    serialization.PublicFormat.SubjectPublicKeyInfo))


class K8sCluster:
    """``K8sCluster().start()``: the control plane in its own network namespace; ``stop()`` by PID."""

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex[:6]
        self.netns = f"bi-k8s-{self.id}"
        self.root = Path(tempfile.mkdtemp(prefix=f"bi-k8s-{self.id}-"))
        self.port = 0  # the API server as the test process sees it: https://127.0.0.1:<port>
        self.tokens = {name: uuid.uuid4().hex for name in ("admin", "controller-manager", "node-agent", "pipeline")}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._listeners: list[socket.socket] = []
        self._netns_made = False

    # -- lifecycle ------------------------------------------------------------------------

    def start(self, timeout_s: float = 90.0) -> K8sCluster:
        _certificates(self.root)
        with (self.root / "tokens.csv").open("w") as f:  # token,user,uid,"groups"
            f.write(f'{self.tokens["admin"]},admin,admin,"system:masters"\n')
            f.write(f'{self.tokens["controller-manager"]},system:kube-controller-manager,kcm\n')
            f.write(f'{self.tokens["node-agent"]},node-agent,node-agent,"system:masters"\n')
            f.write(f'{self.tokens["pipeline"]},pipeline,pipeline\n')  # no groups: only what RBAC grants it
        self._network()
        self.port = self.forward(API_PORT)
        self._spawn("etcd", ["etcd", "--name", "bi", "--data-dir", str(self.root / "etcd"),
                             "--listen-client-urls", "http://127.0.0.1:2379", "--advertise-client-urls", "http://127.0.0.1:2379",
                             "--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
                             "--initial-cluster", "bi=http://127.0.0.1:2380", "--log-level", "warn"])
        r = self.root
        self._spawn("kube-apiserver", [
            str(K8S_BIN / "kube-apiserver"), "--etcd-servers=http://127.0.0.1:2379", "--bind-address=0.0.0.0",
            f"--advertise-address={GATEWAY}", f"--secure-port={API_PORT}", "--insecure-port=0",
            f"--tls-cert-file={r / 'apiserver.crt'}", f"--tls-private-key-file={r / 'apiserver.key'}",
            f"--client-ca-file={r / 'ca.crt'}", f"--token-auth-file={r / 'tokens.csv'}", "--anonymous-auth=false",
            "--authorization-mode=RBAC", f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--service-account-key-file={r / 'sa.pub'}", f"--service-account-signing-key-file={r / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local", f"--cert-dir={r / 'certs'}",
            "--profiling=false", "--v=0"])
        self._wait_ready(timeout_s)
        (r / "kcm.kubeconfig").write_text(self.kubeconfig("controller-manager", inside=True))
        self._spawn("kube-controller-manager", [
            str(K8S_BIN / "kube-controller-manager"), f"--kubeconfig={r / 'kcm.kubeconfig'}", "--leader-elect=false",
            "--port=0", "--secure-port=0", f"--service-account-private-key-file={r / 'sa.key'}",
            f"--root-ca-file={r / 'ca.crt'}", f"--cluster-signing-cert-file={r / 'ca.crt'}",
            f"--cluster-signing-key-file={r / 'ca.key'}", "--use-service-account-credentials=true",
            "--concurrent-deployment-syncs=2", "--concurrent-endpoint-syncs=2", "--v=0"])
        self._wait_service_account(timeout_s)
        return self

    def start_agent(self, *, run_prefixes: tuple[str, ...] = (), gpus: int = 4, node: str = "gpu-node-0",
                    timeout_s: float = 30.0) -> None:
        """The node agent (``node_agent.py``) in the cluster namespace; waits for its Node to be Ready."""
        argv = [sys.executable, "-m", "batch_inference_tests.k8s.node_agent",
                f"--kubeconfig={self.kubeconfig_file('node-agent', inside=True)}", f"--node={node}", f"--gpus={gpus}",
                f"--netns-prefix={self.netns}", f"--workdir={self.root / 'node'}"]
        self._spawn("node-agent", argv + [f"--run-namespace-prefix={p}" for p in run_prefixes])

        def ready() -> bool:
            conditions = json.loads(self.get(f"/api/v1/nodes/{node}")).get("status", {}).get("conditions", [])
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

        self._poll(ready, timeout_s, f"node {node} not Ready after {timeout_s:.0f}s", "node-agent")

    def stop_one(self, name: str, timeout_s: float = 15) -> None:
        """Stop one of the cluster's processes by PID (SIGTERM, then SIGKILL)."""
        proc = self.procs.pop(name, None)
        if proc is not None and proc.poll() is None:
            stop_pid(proc.pid, sig=signal.SIGTERM, timeout_s=timeout_s)
        if proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            proc = self.procs.pop(name)
            if proc.poll() is None:
                stop_pid(proc.pid, sig=signal.SIGTERM, timeout_s=10)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for listener in self._listeners:
            listener.close()
        self._listeners.clear()
        if self._netns_made:
            for ns in sh("ip", "netns", "list").split("\n"):
                name = ns.split(" ")[0]
                if name == self.netns or name.startswith(f"{self.netns}-"):
                    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
            self._netns_made = False
        shutil.rmtree(self.root, ignore_errors=True)

    def _network(self) -> None:
        sh("ip", "netns", "add", self.netns)
        self._netns_made = True
        sh("ip", "-n", self.netns, "link", "set", "lo", "up")
        sh("ip", "-n", self.netns, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.netns, "addr", "add", f"{GATEWAY}/24", "dev", "br0")
        sh("ip", "-n", self.netns, "link", "set", "br0", "up")

    def forward(self, target_port: int, listen_port: int = 0) -> int:
        """Make ``127.0.0.1:<target_port>`` inside the cluster namespace reachable from the test
        process at ``127.0.0.1:<returned port>`` (``forward.py``); stopped with the cluster."""
        listener = socket.socket()
        listener.bind(("127.0.0.1", listen_port))
        listener.listen(128)
        self._listeners.append(listener)
        self._spawn(f"forward-{target_port}", [sys.executable, "-m", "batch_inference_tests.k8s.forward",
                                               "--fd", str(listener.fileno()), "--to", f"127.0.0.1:{target_port}"],
                    pass_fds=(listener.fileno(),))
        return listener.getsockname()[1]

    def in_netns(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the cluster's network namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def _spawn(self, name: str, argv: list[str], *, env: dict[str, str] | None = None, net_only: bool = False,
               **kw: Any) -> subprocess.Popen[bytes]:
        """``net_only``: enter the cluster's network namespace alone (``nsenter --net``), keeping the
        host's mounts. ``ip netns exec`` also makes a mount namespace with a fresh /sys, where the
        cgroup hierarchies are missing and mounts made (a pod's volumes) are seen by nobody else:
        the kubelet, containerd and kube-proxy need the former."""
        log = (self.root / f"{name}.log").open("ab")
        wrapped = ["nsenter", f"--net=/var/run/netns/{self.netns}", "--", *argv] if net_only else self.in_netns(argv)
        proc = subprocess.Popen(wrapped, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=env or {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}, **kw)
        log.close()
        self.procs[name] = proc
        return proc

    def pod_log(self, uid: str, chars: int = 3000) -> str:
        """The tail of what a pod's process printed (the node agent keeps it while the pod lives)."""
        path = self.root / "node" / "pods" / uid / "container.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else f"(no log for pod {uid})"

    def log_tail(self, name: str, chars: int = 3000) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}: {self.log_tail(name)}")

    def _poll(self, probe: Callable[[], bool], timeout_s: float, failure: str, log_of: str) -> None:
        """Until ``probe()`` holds (an OSError counts as not yet); every process must stay up.
        After ``timeout_s`` a TimeoutError says ``failure`` with the tail of ``log_of``'s log."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive()
            try:
                if probe():
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{failure}: {self.log_tail(log_of)}")
            time.sleep(0.2)

    def _wait_ready(self, timeout_s: float) -> None:
        self._poll(lambda: self.get("/readyz") == "ok", timeout_s,
                   f"kube-apiserver not ready after {timeout_s:.0f}s", "kube-apiserver")

    def _wait_service_account(self, timeout_s: float) -> None:
        """The controller manager is working once it has created the default ServiceAccount's token."""
        self._poll(lambda: bool(json.loads(self.get("/api/v1/namespaces/default/serviceaccounts/default")).get("secrets")),
                   timeout_s, "kube-controller-manager made no service account token", "kube-controller-manager")

    # -- clients ----------------------------------------------------------------------------

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def get(self, path: str, user: str = "admin") -> str:
        ctx = ssl.create_default_context(cafile=str(self.root / "ca.crt"))
        req = urllib.request.Request(self.server + path, headers={"Authorization": f"Bearer {self.tokens[user]}"})
        with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
            return resp.read().decode()

    def kubeconfig(self, user: str = "admin", *, inside: bool = False) -> str:
        """A kubeconfig for ``user``; ``inside``: for processes in the cluster namespace."""
        server = f"https://127.0.0.1:{API_PORT}" if inside else self.server
        ca = base64.b64encode((self.root / "ca.crt").read_bytes()).decode()
        return yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "bi",
            "clusters": [{"name": "bi", "cluster": {"server": server, "certificate-authority-data": ca}}],
            "users": [{"name": user, "user": {"token": self.tokens[user]}}],
            "contexts": [{"name": "bi", "context": {"cluster": "bi", "user": user, "namespace": "default"}}],
        })

    def kubeconfig_file(self, user: str = "admin", *, inside: bool = False) -> Path:
        path = self.root / f"{user}{'-inside' if inside else ''}.kubeconfig"
        if not path.exists():
            path.write_text(self.kubeconfig(user, inside=inside))
        return path

    def api_client(self, user: str = "admin") -> Any:
        from kubernetes import config

        return config.new_client_from_config(str(self.kubeconfig_file(user)))

    def kubectl(self, *args: str, user: str = "admin", check: bool = True, stdin: str | None = None,
                timeout: float = 60) -> subprocess.CompletedProcess[str]:
        out = subprocess.run([str(K8S_BIN / "kubectl"), f"--kubeconfig={self.kubeconfig_file(user)}", *args], input=stdin,
                             capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} exited {out.returncode}: {out.stderr}")
        return out
