"""``/v1/chat/completions``: the pipeline's own request; its body passes as it is."""

from __future__ import annotations

from typing import Any

from batch_inference.api.endpoints.base import Endpoint


def _request(body: dict[str, Any]) -> dict[str, Any]:
    return body


ENDPOINT = Endpoint(url="/v1/chat/completions", pipeline_url="/v1/chat/completions", request=_request)
