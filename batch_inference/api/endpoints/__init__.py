"""The Batch API endpoints, one file each, and their registry (``ENDPOINTS``).

A new endpoint is one file here defining an ``Endpoint`` (``base``: url, the body -> the
pipeline's request, the pipeline's answer -> the response body) and one line below.
"""

from __future__ import annotations

from batch_inference.api.endpoints import chat, completions, embeddings, responses
from batch_inference.api.endpoints.base import Answered, Endpoint, Refused

ENDPOINTS: dict[str, Endpoint] = {e.url: e for e in (
    chat.ENDPOINT,
    completions.ENDPOINT,
    responses.ENDPOINT,
    embeddings.ENDPOINT,
)}

__all__ = ["ENDPOINTS", "Answered", "Endpoint", "Refused"]
