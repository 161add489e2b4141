"""Asset keys shared by assets, checks and the sensor (one place to rename them)."""

from __future__ import annotations

import dagster as dg

SOURCE = dg.AssetKey("source_dataset")
SHARDED = dg.AssetKey("sharded")
PENDING = dg.AssetKey("pending")
INFERRED = dg.AssetKey("inferred")
APPROVED = dg.AssetKey("approved")
REJECTED = dg.AssetKey("rejected")
FAILED = dg.AssetKey("failed")
REVIEWED = dg.AssetKey("reviewed")
TAIL_RETRY = dg.AssetKey("tail_retry")
RESULTS = dg.AssetKey("results")
OPENAI_EXPORT = dg.AssetKey("openai_batch_export")
PARQUET_EXPORT = dg.AssetKey("parquet_export")

# Kubernetes: a GPU step's pod asks for one GPU and lands on GPU nodes. Applies under
# the k8s_job_executor (one pod per step); with the persistent pool the GPU work runs in
# the pool's pods and these steps only drive it, so deployments that use the pool may
# drop the request (see docs/dagster.md).
GPU_K8S_CONFIG: dict = {
    "container_config": {
        "resources": {
            "requests": {"cpu": "1", "memory": "4Gi", "nvidia.com/gpu": "1"},
            "limits": {"memory": "8Gi", "nvidia.com/gpu": "1"},
        }
    },
    "pod_spec_config": {
        "node_selector": {"nvidia.com/gpu.present": "true"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    },
}
GPU_OP_TAGS: dict = {"dagster-k8s/config": GPU_K8S_CONFIG, "batch_inference/compute": "gpu"}
CPU_OP_TAGS: dict = {"batch_inference/compute": "cpu"}
# Run tag the queued run coordinator limits (deploy/dagster/dagster.yaml).
GPU_RUN_TAGS: dict[str, str] = {"batch_inference/gpu": "true"}
