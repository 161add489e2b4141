"""The Kubernetes control plane fixture (``make test-infra``): one cluster for the session.

``k8s`` starts etcd, kube-apiserver and kube-controller-manager in a network namespace
of their own plus the test node agent with 4 GPUs; every process is stopped by PID and
every namespace removed at the end, also when a test fails. ``namespace(live=...)``
gives a test its own Kubernetes namespace: ``live`` ones (prefix ``live-``) have their
pods' commands run for real by the node agent; the others are reported Running only.
``k8s_node`` (``make test-pods``) is another cluster with a real node (``node.py``).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator

import pytest

from batch_inference_tests.fixtures.infra import require
from batch_inference_tests.k8s.cluster import K8S_BIN, K8sCluster, binaries_missing
from batch_inference_tests.k8s.helpers import wait_until
from batch_inference_tests.k8s.node import RealNode, build_images, node_missing

LIVE_PREFIX = "live-"


@pytest.fixture(scope="session")
def k8s() -> Iterator[K8sCluster]:
    missing = binaries_missing()
    require(not missing, f"Kubernetes control plane not built/installed ({', '.join(missing)})")
    require(os.geteuid() == 0 and shutil.which("ip") is not None, "network namespaces need root and iproute2")
    cluster = K8sCluster()
    try:
        cluster.start()
        cluster.start_agent(run_prefixes=(LIVE_PREFIX,), gpus=4)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def namespace(k8s: K8sCluster) -> Iterator[Callable[..., str]]:
    """``namespace(live=False) -> name``: a fresh Kubernetes namespace, deleted at teardown."""
    from kubernetes import client

    core = client.CoreV1Api(k8s.api_client())
    made: list[str] = []

    def make(live: bool = False) -> str:
        name = f"{LIVE_PREFIX if live else 'cfg-'}{uuid.uuid4().hex[:8]}"
        core.create_namespace({"metadata": {"name": name}})
        made.append(name)
        return name

    yield make
    for name in made:  # everything in it; its pods' GPUs are free again once it is gone
        core.delete_namespace(name)
    for name in made:  # bounded, generously: on 2 loaded cores the controllers can take a while
        wait_until(lambda: name not in {n.metadata.name for n in core.list_namespace().items}, 240,
                   f"namespace {name} to go (its pods when the wait began: {[p.metadata.name for p in core.list_namespaced_pod(name).items]})")


@pytest.fixture(scope="session")
def k8s_node() -> Iterator[tuple[K8sCluster, RealNode]]:
    """A second cluster whose node is real (``node.py``): kubelet + containerd + runc running
    the project's image, kube-scheduler, kube-proxy. No node agent in it."""
    missing = binaries_missing() + node_missing(K8S_BIN)
    require(not missing, f"Kubernetes node not built/installed ({', '.join(missing)})")
    require(os.geteuid() == 0 and shutil.which("ip") is not None, "a node needs root and iproute2")
    images = build_images()  # cached by .ci/build_k8s_node.sh; a miss builds them (minutes)
    cluster = K8sCluster()
    node: RealNode | None = None
    try:
        cluster.start()
        node = RealNode(cluster, K8S_BIN)
        node.start(images)
        yield cluster, node
    finally:
        if node is not None:
            node.stop()
        cluster.stop()
