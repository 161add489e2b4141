"""Prompting: how a record becomes an engine request (text or chat, sampling, response format).

The layer between judges/engines and the pool: ``InferConfig`` says where a record's
prompt comes from; ``RequestBuilder`` turns a record into a ``Request``; chat messages
stay messages until the engine renders them with its model's chat template. The OpenAI
Batch format (in and out) lives here too (``prompting.openai_batch``).
"""

from __future__ import annotations

from batch_inference.prompting.builder import (
    REQUEST_ERROR_KINDS,
    Request,
    RequestBuilder,
    RequestError,
    derive_seed,
    parse_messages,
)
from batch_inference.prompting.config import (
    InferConfig,
    JsonSchemaFormat,
    MessageTemplate,
    ResponseFormatConfig,
    SamplingConfig,
    SamplingLimits,
)

__all__ = [
    "REQUEST_ERROR_KINDS",
    "InferConfig",
    "JsonSchemaFormat",
    "MessageTemplate",
    "Request",
    "RequestBuilder",
    "RequestError",
    "ResponseFormatConfig",
    "SamplingConfig",
    "SamplingLimits",
    "derive_seed",
    "parse_messages",
]
