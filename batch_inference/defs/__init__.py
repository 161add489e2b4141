"""Dagster wiring over the pipeline layer: partitions, assets, checks, sensors, schedules.

One folder per domain, each with its ``assets.py`` / ``resources.py`` / ``sensors.py`` /
``schedules.py`` / ``checks.py`` side by side and a ``definitions.py`` that builds the
domain's ``Definitions``; ``batch_inference.definitions`` merges them (the
dagster-open-platform layout):

- ``runs/``    a pipeline run as a whole: the source drop, sharding, the tail, results
- ``rounds/``  Strategy 1 rounds: pending -> inferred -> approved/rejected/failed, the
               sensor that drives a run from one step to the next
- ``review/``  closing a round's human review (the ``reviewed`` asset, its age check)
- ``pool/``    the resource that reaches the persistent worker pool
- ``storage/`` the resource that maps S3 settings onto fsspec storage options

Every asset body is a call to one ``PipelineRun`` step; the Dagster layer adds lineage,
scheduling, checks and metadata, never inference logic.
"""

import warnings

# Partitioned asset checks (one result per run / round partition) are "preview" in Dagster 1.13.
warnings.filterwarnings("ignore", message="Specifying a partitions_def on an AssetCheckSpec is currently in preview")
