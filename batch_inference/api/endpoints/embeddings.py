"""``/v1/embeddings``: the pipeline's own embeddings request line (``prompting.embeddings``), which
the pipeline reads and answers itself (its output line's body is OpenAI's embeddings ``list``).

Only an embedding model answers it (its ``engine.task: embed`` in the API config), and an
embedding model answers nothing else: ``endpoint_mismatch`` is the intake's per-line check,
``infer_keys`` the spec keys a model's batches run with. The body's own refusals (several
inputs, token ids, an ``encoding_format`` or ``dimensions`` it cannot give) fail that line alone.
"""

from __future__ import annotations

from typing import Any

from batch_inference.api.endpoints.base import Endpoint, Refused
from batch_inference.prompting.embeddings import URL, EmbeddingsRefusal, endpoint_mismatch, infer_keys, to_record


def _request(body: dict[str, Any]) -> dict[str, Any] | Refused:
    try:
        to_record("-", body)
    except EmbeddingsRefusal as exc:
        return Refused(str(exc), param=exc.param)
    return body


ENDPOINT = Endpoint(url=URL, pipeline_url=URL, request=_request)

__all__ = ["ENDPOINT", "endpoint_mismatch", "infer_keys"]
