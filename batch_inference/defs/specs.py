"""Where a pipeline run's spec lives for the Dagster layer: on its source materialisation.

Starting a run (the start job, by hand or from a schedule) validates the spec and
records it, secrets redacted, as JSON metadata on ``source_dataset[<run>]``. Every later
step of that run, in whatever process or pod, reads it back from the Dagster instance
and merges in the storage credentials of the :class:`StorageResource` it was given. One
source of truth, visible in the UI, and credentials never stored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import dagster as dg

from batch_inference.defs.keys import SOURCE

if TYPE_CHECKING:
    from batch_inference.defs.storage.resources import StorageResource
    from batch_inference.pipeline import PipelineSpec

SPEC_METADATA_KEY = "spec"


class SpecNotFound(LookupError):
    """No source materialisation for this run: it was never started."""


def recorded_spec(instance: dg.DagsterInstance, run: str, source: dg.AssetKey = SOURCE) -> dict[str, Any]:
    """The public spec recorded when run ``run`` was started (latest start wins) on ``source`` (its pipeline's)."""
    result = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=source, asset_partitions=[run]), limit=1, ascending=False
    )
    if not result.records:
        raise SpecNotFound(
            f"pipeline run {run!r} has no {source.to_user_string()} materialisation: start it (materialise "
            f"{source.to_user_string()} for a new partition, the start_pipeline_run job or `batch-inference demo`) before materialising its assets"
        )
    materialization = result.records[0].asset_materialization
    assert materialization is not None
    value = materialization.metadata.get(SPEC_METADATA_KEY)
    if value is None or not isinstance(value.value, dict):
        raise SpecNotFound(f"pipeline run {run!r}: its source materialisation carries no {SPEC_METADATA_KEY!r} metadata")
    return dict(value.value)


def load_spec(instance: dg.DagsterInstance, run: str, storage: StorageResource, source: dg.AssetKey = SOURCE) -> PipelineSpec:
    """The run's spec with this process's storage credentials merged in."""
    from batch_inference.pipeline import PipelineSpec

    data = recorded_spec(instance, run, source)
    data["storage_options"] = storage.storage_options()  # recorded ones are redacted
    return PipelineSpec.parse(data, source=f"spec of pipeline run {run!r}")
