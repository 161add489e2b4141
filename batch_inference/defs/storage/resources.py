"""Object storage settings for the pipeline, in dagster-aws's vocabulary.

The fields are named exactly as ``dagster_aws.s3.S3Resource``'s (a test keeps them in
step), so a deployment configures S3 once, the Dagster way; :meth:`storage_options`
maps them onto the fsspec/s3fs options the storage layer takes (``JsonlDir(url,
storage_options=...)``). Credentials stay out of the spec and the ledger: they are
merged into a run's spec only in the process that executes a step.
"""

from __future__ import annotations

from typing import Any

import dagster as dg
from pydantic import Field


class StorageResource(dg.ConfigurableResource):
    """Where runs write (``base_url``) and how to reach it (S3 settings, all optional)."""

    base_url: str | None = Field(None, description="default output base for runs whose spec omits it; e.g. s3://bucket/runs")
    region_name: str | None = None
    endpoint_url: str | None = Field(None, description="an S3-compatible endpoint (MinIO, moto, R2)")
    max_attempts: int = 5
    profile_name: str | None = None
    use_ssl: bool = True
    verify: bool | None = None
    aws_access_key_id: str | None = None
    aws_secret_access_key: str | None = None
    aws_session_token: str | None = None
    use_unsigned_session: bool = False

    @classmethod
    def from_s3_resource(cls, s3: Any, *, base_url: str | None = None) -> StorageResource:
        """Reuse a configured ``dagster_aws.s3.S3Resource`` (same field names)."""
        fields = {name: getattr(s3, name) for name in cls.model_fields if name != "base_url" and hasattr(s3, name)}
        return cls(base_url=base_url, **fields)

    def storage_options(self) -> dict[str, Any]:
        """The s3fs options for these settings; ``{}`` when nothing is set (local paths)."""
        opts: dict[str, Any] = {}
        if self.aws_access_key_id:
            opts["key"] = self.aws_access_key_id
        if self.aws_secret_access_key:
            opts["secret"] = self.aws_secret_access_key
        if self.aws_session_token:
            opts["token"] = self.aws_session_token
        if self.profile_name:
            opts["profile"] = self.profile_name
        if self.use_unsigned_session:
            opts["anon"] = True
        if self.endpoint_url:
            opts["endpoint_url"] = self.endpoint_url
        if not self.use_ssl:
            opts["use_ssl"] = False
        client_kwargs: dict[str, Any] = {}
        if self.region_name:
            client_kwargs["region_name"] = self.region_name
        if self.verify is not None:
            client_kwargs["verify"] = self.verify
        if client_kwargs:
            opts["client_kwargs"] = client_kwargs
        if self.max_attempts != 5:
            opts["config_kwargs"] = {"retries": {"max_attempts": self.max_attempts}}
        return opts
