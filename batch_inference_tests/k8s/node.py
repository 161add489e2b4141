"""A real Kubernetes node for the tests: containerd + runc, kubelet, kube-scheduler and kube-proxy.

Started inside the cluster's network namespace (``cluster.py``) after the control plane,
so pods get their own network namespaces from containerd's CNI plugins (Debian's
``containernetworking-plugins``: ``bridge`` on the cluster's ``br0`` with ``host-local``
addresses in 10.244.0.0/24) and Services get ClusterIPs that kube-proxy's iptables rules
serve inside that namespace. Pods run the images ``.ci/build_k8s_node.sh`` builds (the
project's worker image and a pause image), imported into this node's own containerd; no
registry is reached. Every process is stopped by PID with the cluster; containers are
removed through the CRI first so no runc process outlives the test.

cgroup v1 with the cgroupfs driver; ``cgroupsPerQOS`` is off (one flat level of pod
cgroups under the node's cgroup root) so the kubelet does not need to own the machine's
cgroup hierarchy, which other sessions share. Resource limits are still applied to each
container's cgroup by runc.

The node advertises ``nvidia.com/gpu`` the way the Kubernetes docs describe for extended
resources without a device plugin (a PATCH of the Node's status), so the launcher's GPU
requests schedule; no GPU is attached.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from batch_inference_tests.k8s.cluster import SERVICE_CIDR

if TYPE_CHECKING:
    from batch_inference_tests.k8s.cluster import K8sCluster

REPO = Path(__file__).resolve().parents[2]
NODE_BINARIES = ("kubelet", "kube-scheduler", "kube-proxy")
HOST_TOOLS = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "iptables", "conntrack")
CNI_BIN = Path("/usr/lib/cni")
PAUSE_IMAGE = "batch-inference.test/pause:3.2"
POD_CIDR = "10.244.0.0/24"


def node_missing(k8s_bin: Path) -> list[str]:
    """What a real node lacks here (``.ci/build_k8s.sh`` and ``.ci/build_k8s_node.sh`` provide it)."""
    missing = [str(k8s_bin / b) for b in NODE_BINARIES if not (k8s_bin / b).exists()]
    missing += [t for t in HOST_TOOLS if shutil.which(t) is None]
    missing += [str(CNI_BIN / p) for p in ("bridge", "host-local", "loopback") if not (CNI_BIN / p).exists()]
    return missing


def build_images() -> dict[str, Path]:
    """The pause and worker image archives (cached; built on a miss, which takes minutes)."""
    out = subprocess.run(["bash", str(REPO / ".ci" / "build_k8s_node.sh")], capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f".ci/build_k8s_node.sh exited {out.returncode}: {out.stderr[-3000:]}")
    found = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    return {"pause": Path(found["PAUSE_ARCHIVE"]), "image": Path(found["IMAGE_ARCHIVE"])}


class RealNode:
    """``RealNode(cluster, k8s_bin).start(images)``: one node named ``name``; stopped with ``stop()``."""

    def __init__(self, cluster: K8sCluster, k8s_bin: Path, name: str = "node-0", gpus: int = 4) -> None:
        self.cluster, self.bin, self.name, self.gpus = cluster, k8s_bin, name, gpus
        self.root = cluster.root / "node"
        self.sock = self.root / "containerd" / "containerd.sock"
        self.cgroup_root = f"/bi-k8s-{cluster.id}"

    # -- lifecycle ------------------------------------------------------------------------

    def start(self, images: dict[str, Path], timeout_s: float = 180.0) -> RealNode:
        c = self.cluster
        self._containerd()
        for archive in images.values():
            self.ctr("images", "import", str(archive), timeout=600)
        (self.root / "kubelet.kubeconfig").write_text(c.kubeconfig("node-agent", inside=True))
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                               "x509": {"clientCAFile": str(c.root / "ca.crt")}},
            "authorization": {"mode": "AlwaysAllow"},
            "address": "127.0.0.1", "readOnlyPort": 0, "healthzBindAddress": "127.0.0.1", "healthzPort": 10248,
            "cgroupDriver": "cgroupfs", "cgroupsPerQOS": False, "enforceNodeAllocatable": [],
            "cgroupRoot": self.cgroup_root, "failSwapOn": False, "hairpinMode": "hairpin-veth",
            "serializeImagePulls": False, "resolvConf": "/etc/resolv.conf", "maxPods": 50,
            "evictionHard": {"memory.available": "50Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "nodeStatusUpdateFrequency": "4s", "syncFrequency": "5s", "fileCheckFrequency": "60s",
        }
        (self.root / "kubelet.yaml").write_text(yaml.safe_dump(config))
        for sub in self._cgroup_hierarchies():  # the kubelet checks its cgroup root exists in each
            Path(f"/sys/fs/cgroup/{sub}{self.cgroup_root}").mkdir(parents=True, exist_ok=True)
        c._spawn("kubelet", [
            str(self.bin / "kubelet"), f"--config={self.root / 'kubelet.yaml'}", f"--kubeconfig={self.root / 'kubelet.kubeconfig'}",
            "--container-runtime=remote", f"--container-runtime-endpoint=unix://{self.sock}",
            f"--root-dir={self.root / 'kubelet'}", f"--cert-dir={self.root / 'kubelet-pki'}",
            f"--hostname-override={self.name}", "--node-ip=10.244.0.1", "--register-node=true", "--v=1"], net_only=True)
        c._spawn("kube-scheduler", [
            str(self.bin / "kube-scheduler"), f"--kubeconfig={c.kubeconfig_file('admin', inside=True)}",
            "--leader-elect=false", "--port=0", "--secure-port=0", "--v=0"])
        c._spawn("kube-proxy", [
            str(self.bin / "kube-proxy"), f"--kubeconfig={c.kubeconfig_file('admin', inside=True)}",
            f"--hostname-override={self.name}", "--proxy-mode=iptables", f"--cluster-cidr={POD_CIDR}",
            "--conntrack-max-per-core=0", "--metrics-bind-address=127.0.0.1:10249",
            "--healthz-bind-address=127.0.0.1:10256", "--v=0"], net_only=True)
        # Service addresses need a route for kube-proxy's DNAT to apply to (the namespace has no default route)
        subprocess.run(["ip", "-n", c.netns, "route", "add", SERVICE_CIDR, "dev", "br0"], check=True, capture_output=True,
                       timeout=30)
        c._poll(self._ready, timeout_s, f"node {self.name} not Ready after {timeout_s:.0f}s", "kubelet")
        self._advertise_gpus()
        return self

    def stop(self) -> None:
        """Remove every pod sandbox through the CRI (their runc processes go with them), then
        the node's processes are stopped by PID with the cluster; the cgroups are removed."""
        crictl = shutil.which("crictl")
        if self.sock.exists():
            try:
                if crictl:
                    subprocess.run([crictl, "-r", f"unix://{self.sock}", "rmp", "-fa"], capture_output=True, timeout=60)
                for ns in ("k8s.io",):
                    tasks = self.ctr("-n", ns, "tasks", "ls", "-q", check=False).split()
                    for task in tasks:
                        self.ctr("-n", ns, "tasks", "kill", "-s", "SIGKILL", task, check=False)
            except (subprocess.SubprocessError, OSError):
                pass
        for name in ("kube-proxy", "kube-scheduler", "kubelet"):
            self.cluster.stop_one(name)
        time.sleep(1)
        self.cluster.stop_one("containerd")
        for sub in self._cgroup_hierarchies():
            top = Path(f"/sys/fs/cgroup/{sub}{self.cgroup_root}")
            if top.exists():  # deepest first; a cgroup with a process left in it stays (and is reported)
                for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [top]:
                    try:
                        d.rmdir()
                    except OSError:
                        pass
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines() if str(self.root) in line.split()[1]]
        for mount in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", mount], capture_output=True, timeout=30)

    # -- pieces ---------------------------------------------------------------------------

    @staticmethod
    def _cgroup_hierarchies() -> list[str]:
        """The cgroup v1 hierarchies mounted under /sys/fs/cgroup (``cpu``, ``memory``, ``systemd``...)."""
        out = []
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, fstype, *_ = line.split()
            if fstype == "cgroup" and mount.startswith("/sys/fs/cgroup/"):
                out.append(mount.removeprefix("/sys/fs/cgroup/"))
        return out

    def _containerd(self) -> None:
        d = self.root / "containerd"
        (self.root / "cni").mkdir(parents=True, exist_ok=True)
        (self.root / "cni" / "10-bridge.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": "bi-pods", "plugins": [
                {"type": "bridge", "bridge": "br0", "isGateway": True, "ipMasq": False, "hairpinMode": True,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR, "rangeStart": "10.244.0.10",
                                                              "rangeEnd": "10.244.0.250", "gateway": "10.244.0.1"}]],
                          # a default route in the pod: a Service's ClusterIP is reached through the
                          # node (kube-proxy's DNAT), not on the pod's link
                          "routes": [{"dst": "0.0.0.0/0"}],
                          "dataDir": str(self.root / "cni-ipam")}}]}))
        d.mkdir(parents=True, exist_ok=True)
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        (d / "config.toml").write_text(f"""version = 2
root = "{d / 'root'}"
state = "{d / 'state'}"
[grpc]
  address = "{self.sock}"
[ttrpc]
  address = "{d / 'ttrpc.sock'}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{d / 'opt'}"
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  enable_selinux = false
  disable_apparmor = true
  restrict_oom_score_adj = true
  # the pods' network namespaces under this node's own state folder (not /var/run/netns,
  # shared by the machine): stop() unmounts them with the rest of the node
  netns_mounts_under_state_dir = true
[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[{cri}.containerd.runtimes.runc.options]
  BinaryName = "{shutil.which('runc')}"
  SystemdCgroup = false
[{cri}.cni]
  bin_dir = "{CNI_BIN}"
  conf_dir = "{self.root / 'cni'}"
""")
        self.cluster._spawn("containerd", ["containerd", "--config", str(d / "config.toml"), "--log-level", "warn"],
                             net_only=True)
        self.cluster._poll(lambda: self.sock.exists() and bool(self.ctr("version", check=False)), 60,
                           "containerd did not start", "containerd")

    def ctr(self, *args: str, check: bool = True, timeout: float = 60) -> str:
        argv = ["ctr", "-a", str(self.sock), *(args if args[:1] == ("-n",) else ("-n", "k8s.io", *args))]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {out.returncode}: {out.stderr[-2000:]}")
        return out.stdout

    def _ready(self) -> bool:
        conditions = json.loads(self.cluster.get(f"/api/v1/nodes/{self.name}")).get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def _advertise_gpus(self) -> None:
        """Extended resources without a device plugin: PATCH the Node's status (kubectl cannot patch status in 1.20)."""
        import ssl

        body = json.dumps([{"op": "add", "path": "/status/capacity/nvidia.com~1gpu", "value": str(self.gpus)}]).encode()
        req = urllib.request.Request(f"{self.cluster.server}/api/v1/nodes/{self.name}/status", data=body, method="PATCH",
                                     headers={"Authorization": f"Bearer {self.cluster.tokens['admin']}",
                                              "Content-Type": "application/json-patch+json"})
        ctx = ssl.create_default_context(cafile=str(self.cluster.root / "ca.crt"))
        urllib.request.urlopen(req, context=ctx, timeout=10).read()

        def advertised() -> bool:
            node = json.loads(self.cluster.get(f"/api/v1/nodes/{self.name}"))
            return node["status"].get("allocatable", {}).get("nvidia.com/gpu") == str(self.gpus)

        self.cluster._poll(advertised, 60, "the node did not advertise nvidia.com/gpu", "kubelet")

    @staticmethod
    def pod_log(namespace: str, pod: str) -> str:
        """The kubelet's log files of a pod's containers (/var/log/pods: not configurable in 1.20)."""
        logs = sorted(Path("/var/log/pods").glob(f"{namespace}_{pod}_*/*/*.log"))
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in logs) or f"(no log for {namespace}/{pod})"
