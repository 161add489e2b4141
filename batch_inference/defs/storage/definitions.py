"""The storage domain's definitions: the ``storage`` resource, from the environment unless given.

    BATCH_INFERENCE_BASE_URL         output base for every run (else each spec's ``output``)
    AWS_REGION, AWS_ENDPOINT_URL_S3  S3 settings (credentials: the standard AWS chain)
"""

from __future__ import annotations

import os

import dagster as dg

from batch_inference.defs.storage.resources import StorageResource


def storage_from_env(env: os._Environ[str] | dict[str, str] = os.environ) -> StorageResource:
    return StorageResource(base_url=env.get("BATCH_INFERENCE_BASE_URL") or None, region_name=env.get("AWS_REGION") or None,
                           endpoint_url=env.get("AWS_ENDPOINT_URL_S3") or None)


def build_definitions(storage: StorageResource | None = None) -> dg.Definitions:
    return dg.Definitions(resources={"storage": storage or storage_from_env()})
