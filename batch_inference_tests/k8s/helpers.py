"""Helpers for the Kubernetes tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from kubernetes import client

if TYPE_CHECKING:
    from batch_inference_tests.k8s.cluster import K8sCluster


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.2) -> object:
    """``predicate()``'s first truthy value, polled every ``poll_s``; an AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)


def write_k8s_instance(k8s: K8sCluster, ns: str, config: dict, home: Path, *, postgres_password: str, **launcher: object) -> Path:
    """``home``/dagster.yaml: the instance ``config`` with its K8sRunLauncher aimed at the test
    cluster's namespace ``ns`` (plus ``launcher`` settings), and beside the runs what the Helm
    chart (or an operator) creates there: their ServiceAccount and the Secrets their env comes from."""
    launcher_config = config["run_launcher"]["config"]
    launcher_config.update(job_namespace=ns, load_incluster_config=False, kubeconfig_file=str(k8s.kubeconfig_file()), **launcher)
    home.mkdir()
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))
    core = client.CoreV1Api(k8s.api_client())
    core.create_namespaced_service_account(ns, {"metadata": {"name": launcher_config["service_account_name"]}})
    core.create_namespaced_secret(ns, {"metadata": {"name": launcher_config["postgres_password_secret"]},
                                       "stringData": {"postgresql-password": postgres_password}})
    for name in launcher_config["env_secrets"]:
        core.create_namespaced_secret(ns, {"metadata": {"name": name}, "stringData": {"AWS_ACCESS_KEY_ID": "x"}})
    return home
