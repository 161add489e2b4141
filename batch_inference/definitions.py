"""The Dagster code location: ``dagster dev`` (workspace.yaml) and the demo load ``defs``.

Resources are configured from the environment so one image serves every deployment:

    BATCH_INFERENCE_POOL_MODE        spec | inprocess | local | endpoints   (default: spec)
    BATCH_INFERENCE_POOL_ENDPOINTS   comma-separated worker URLs (endpoints/local modes)
    BATCH_INFERENCE_POOL_TOKEN_ENV   name of the env var holding the workers' bearer token
    BATCH_INFERENCE_BASE_URL         output base for every run (else each spec's ``output``)
    AWS_REGION, AWS_ENDPOINT_URL_S3  S3 settings (credentials: the standard AWS chain)
    BATCH_INFERENCE_SCHEDULE_SPEC    spec file the nightly schedule starts (default .demo/spec.yaml)
    BATCH_INFERENCE_SCHEDULE_CRON    its cron, UTC (default "0 2 * * *")
    BATCH_INFERENCE_SCHEDULE_INPUT   its input URL template, e.g. s3://drops/{date}/prompts.jsonl
"""

from __future__ import annotations

import os

import dagster as dg

from batch_inference.defs.jobs import ASSET_JOBS
from batch_inference.defs.pool.resources import PoolResource
from batch_inference.defs.review.assets import reviewed
from batch_inference.defs.review.checks import review_age
from batch_inference.defs.rounds.assets import inferred, judge, pending
from batch_inference.defs.rounds.checks import quarantine_empty, round_conservation
from batch_inference.defs.rounds.sensors import round_sensor
from batch_inference.defs.runs.assets import openai_batch_export, results, sharded, source_dataset, tail_retry
from batch_inference.defs.runs.checks import run_checks
from batch_inference.defs.runs.jobs import start_pipeline_run
from batch_inference.defs.runs.schedules import build_pipeline_schedule
from batch_inference.defs.storage.resources import StorageResource

ASSETS = [source_dataset, sharded, pending, inferred, judge, reviewed, tail_retry, results, openai_batch_export]
CHECKS = [round_conservation, quarantine_empty, review_age, run_checks]


def pool_from_env(env: os._Environ[str] | dict[str, str] = os.environ) -> PoolResource:
    endpoints = [e.strip() for e in env.get("BATCH_INFERENCE_POOL_ENDPOINTS", "").split(",") if e.strip()]
    return PoolResource(mode=env.get("BATCH_INFERENCE_POOL_MODE", "spec"), endpoints=endpoints,  # type: ignore[arg-type]
                        token_env=env.get("BATCH_INFERENCE_POOL_TOKEN_ENV") or None)


def storage_from_env(env: os._Environ[str] | dict[str, str] = os.environ) -> StorageResource:
    return StorageResource(base_url=env.get("BATCH_INFERENCE_BASE_URL") or None, region_name=env.get("AWS_REGION") or None,
                           endpoint_url=env.get("AWS_ENDPOINT_URL_S3") or None)


def build_definitions(
    *,
    pool: PoolResource | None = None,
    storage: StorageResource | None = None,
    schedule_spec: str | None = None,
    schedule_cron: str | None = None,
    schedule_input: str | None = None,
) -> dg.Definitions:
    """Everything the project defines, with resources and the schedule's spec injectable (tests, demo)."""
    spec_path = schedule_spec or os.environ.get("BATCH_INFERENCE_SCHEDULE_SPEC") or os.path.abspath(".demo/spec.yaml")
    schedule = build_pipeline_schedule(
        spec_path,
        cron_schedule=schedule_cron or os.environ.get("BATCH_INFERENCE_SCHEDULE_CRON", "0 2 * * *"),
        input_template=schedule_input or os.environ.get("BATCH_INFERENCE_SCHEDULE_INPUT") or None,
    )
    return dg.Definitions(
        assets=ASSETS,
        asset_checks=CHECKS,
        jobs=[start_pipeline_run, *ASSET_JOBS],
        sensors=[round_sensor],
        schedules=[schedule],
        resources={"pool": pool or pool_from_env(), "storage": storage or storage_from_env()},
    )


defs = build_definitions()
