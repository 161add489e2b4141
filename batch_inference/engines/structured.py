"""Checking a constrained completion against the format it claims, after generation.

A grammar backend's JSON is not always strict JSON: some admit raw control characters
(U+0000-U+001F) inside strings, which ``json.loads``, orjson and most users' parsers
refuse, and some drop a schema keyword they do not support. So a result that claims a
``ResponseFormat`` is parsed strictly (orjson: RFC 8259) and, for ``json_schema``,
validated against its schema (``jsonschema``) before anyone judges it; the reason it
fails becomes the attempt's ``schema_invalid`` error.
"""

from __future__ import annotations

import functools
from typing import Any

import orjson
from jsonschema.exceptions import best_match
from jsonschema.validators import validator_for

from batch_inference.engines.base import ResponseFormat

MAX_REASON_CHARS = 200


@functools.lru_cache(maxsize=256)
def _validator(schema: str) -> Any:
    """The JSON Schema validator for ``schema`` (its own ``$schema`` draft, else the latest)."""
    parsed = orjson.loads(schema)
    return validator_for(parsed)(parsed)


def schema_check_error(schema: dict[str, Any]) -> str | None:
    """Why ``schema`` is not a valid JSON Schema, or None (a request's schema, checked when it is built)."""
    from jsonschema.exceptions import SchemaError

    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        return f"not a valid JSON Schema: {exc.message} at {exc.json_path}"
    return None


def format_error(text: str, fmt: ResponseFormat) -> str | None:
    """Why ``text`` does not satisfy ``fmt``, or None when it does."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        return f"not strict JSON: {exc}"[:MAX_REASON_CHARS]
    if fmt.kind == "json_object":
        return None if isinstance(value, dict) else f"not a JSON object: a {type(value).__name__}"
    assert fmt.schema is not None
    error = best_match(_validator(fmt.schema).iter_errors(value))
    if error is None:
        return None
    return f"at {error.json_path}: {error.message}"[:MAX_REASON_CHARS]
