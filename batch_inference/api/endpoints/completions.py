"""``/v1/completions``: the pipeline's prompt request (one string ``prompt``); its body passes
as it is and the body of an answer is OpenAI's ``text_completion``."""

from __future__ import annotations

from typing import Any

from batch_inference.api.endpoints.base import Endpoint


def _request(body: dict[str, Any]) -> dict[str, Any]:
    return body


ENDPOINT = Endpoint(url="/v1/completions", pipeline_url="/v1/completions", request=_request)
