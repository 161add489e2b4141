"""Asset keys and names shared by assets, checks and the sensor: one ``PipelineKeys`` per pipeline."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

import dagster as dg

@dataclass(frozen=True)
class PipelineKeys:
    """Every name one pipeline's definitions use: asset keys under its prefix, and the names
    of its partitions, jobs, sensors and schedule (Dagster names cannot hold ``/``, so those
    join the prefix with ``__``).

    The project's own pipeline (the demo's) is ``PipelineKeys()``: no prefix, the names it
    always had. A component instance is ``PipelineKeys(("scoring",))``: ``scoring/results``,
    ``scoring__round_job``, partitions ``scoring__pipeline_runs``, ...
    """

    prefix: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for part in self.prefix:
            if not _NAME.match(part):
                raise ValueError(f"asset key prefix part {part!r}: letters, digits and _ only")

    def key(self, name: str) -> dg.AssetKey:
        return dg.AssetKey([*self.prefix, name])

    def name(self, base: str) -> str:
        """A job/sensor/schedule/partitions name, unique to this pipeline."""
        return "__".join([*self.prefix, base])

    @property
    def group(self) -> str:
        return "_".join(self.prefix) if self.prefix else "batch_inference"

    @property
    def label(self) -> str:
        """How log lines and descriptions name this pipeline."""
        return "/".join(self.prefix) or "batch_inference"

    source = property(lambda self: self.key("source_dataset"))
    sharded = property(lambda self: self.key("sharded"))
    pending = property(lambda self: self.key("pending"))
    inferred = property(lambda self: self.key("inferred"))
    approved = property(lambda self: self.key("approved"))
    rejected = property(lambda self: self.key("rejected"))
    failed = property(lambda self: self.key("failed"))
    reviewed = property(lambda self: self.key("reviewed"))
    tail_retry = property(lambda self: self.key("tail_retry"))
    results = property(lambda self: self.key("results"))
    openai_export = property(lambda self: self.key("openai_batch_export"))
    parquet_export = property(lambda self: self.key("parquet_export"))

    @cached_property
    def runs(self) -> dg.DynamicPartitionsDefinition:
        """One partition per pipeline run (its run name)."""
        return dg.DynamicPartitionsDefinition(name=self.name("pipeline_runs"))

    @cached_property
    def round_numbers(self) -> dg.DynamicPartitionsDefinition:
        return dg.DynamicPartitionsDefinition(name=self.name("round_numbers"))

    @cached_property
    def rounds(self) -> dg.MultiPartitionsDefinition:
        """``pipeline x round``; dimension names sort "pipeline" < "round", so keys read ``"<run>|rNN"``."""
        return dg.MultiPartitionsDefinition({"pipeline": self.runs, "round": self.round_numbers})


_NAME = re.compile(r"^[A-Za-z0-9_]+$")
DEFAULT = PipelineKeys()

SOURCE = DEFAULT.source
SHARDED = DEFAULT.sharded
PENDING = DEFAULT.pending
INFERRED = DEFAULT.inferred
APPROVED = DEFAULT.approved
REJECTED = DEFAULT.rejected
FAILED = DEFAULT.failed
REVIEWED = DEFAULT.reviewed
TAIL_RETRY = DEFAULT.tail_retry
RESULTS = DEFAULT.results
OPENAI_EXPORT = DEFAULT.openai_export
PARQUET_EXPORT = DEFAULT.parquet_export

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

# Dagster's concurrency pool of the GPU steps (infer, judge, tail): its limit (dagster.yaml,
# deploy/dagster/dagster.yaml) is how many GPU steps run at once across every pipeline.
GPU_POOL = "batch_inference_gpu"
