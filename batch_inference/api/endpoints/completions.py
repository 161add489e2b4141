"""``/v1/completions``: the pipeline's prompt request (one string ``prompt``); the body of an
answer is OpenAI's ``text_completion``.

Honoured: ``model``, ``prompt`` (one string), ``max_tokens``, ``temperature``, ``top_p``,
``stop``, ``seed``, ``n`` (1), ``presence_penalty``, ``frequency_penalty``. ``echo``,
``best_of``, ``suffix`` and ``logprobs`` are accepted at the values that ask for nothing
(``false``, 1, null, null/0) and refuse the line otherwise, as does ``logit_bias`` or a
``stream``; the pipeline's check refuses any other field.
"""

from __future__ import annotations

from typing import Any

from batch_inference.api.endpoints.base import Endpoint, Refused, keep_unless

OFF = {"echo": (False, None), "best_of": (1, None), "suffix": (None, ""), "logprobs": (None, 0, False), "stream": (False, None),
       "logit_bias": (None,)}
WHY = {"echo": "echoing the prompt is not supported", "best_of": "best_of > 1 is not supported (one completion a request)",
       "suffix": "suffix (insertion) is not supported", "logprobs": "log probabilities are not returned by this server",
       "stream": "a batch request is not streamed", "logit_bias": "logit_bias is not supported"}


def _request(body: dict[str, Any]) -> dict[str, Any] | Refused:
    kept = keep_unless(body, OFF)
    for name in WHY:
        if name in kept:
            return Refused(f"{name}: {WHY[name]}", param=name)
    return kept


ENDPOINT = Endpoint(url="/v1/completions", pipeline_url="/v1/completions", request=_request)
