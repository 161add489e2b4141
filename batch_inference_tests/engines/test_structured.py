"""Checking constrained completions after generation: strict JSON, then the schema."""

from __future__ import annotations

import json

from batch_inference.engines import ResponseFormat
from batch_inference.engines.config import EngineConfig
from batch_inference.engines.structured import format_error, schema_check_error
from batch_inference.engines.vllm_engine import engine_kwargs

SCHEMA = ResponseFormat("json_schema", json.dumps({
    "type": "object", "required": ["label", "score", "tags"], "additionalProperties": False,
    "properties": {"label": {"enum": ["good", "bad"]}, "score": {"type": "integer", "minimum": 1, "maximum": 5},
                   "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 4}}}}))


def test_a_constrained_completion_is_strict_json_valid_against_its_schema() -> None:
    assert format_error('{"label": "good", "score": 5, "tags": ["ab"]}', SCHEMA) is None
    assert format_error('{"label": "good", "score": 5, "tags": ["a\\u0001"]}', SCHEMA) is None  # escaped: valid JSON
    assert format_error('{"label": "good", "score": 5, "tags": ["a\x01"]}', SCHEMA).startswith("not strict JSON: unexpected control character")
    assert format_error('{"label": "good", "score": 6, "tags": []}', SCHEMA) == "at $.score: 6 is greater than the maximum of 5"
    assert format_error('{"label": "meh", "score": 1, "tags": []}', SCHEMA).startswith("at $.label: 'meh' is not one of")
    assert format_error('{"label": "bad", "score": 1, "tags": ["toolong"]}', SCHEMA) == "at $.tags[0]: 'toolong' is too long"
    assert format_error('{"label": "bad", "score": 1}', SCHEMA) == "at $: 'tags' is a required property"
    assert format_error("NaN", ResponseFormat("json_object")).startswith("not strict JSON")
    assert format_error("[1]", ResponseFormat("json_object")) == "not a JSON object: a list"
    assert format_error('{"x": [1]}', ResponseFormat("json_object")) is None
    assert schema_check_error({"type": "objekt"}).startswith("not a valid JSON Schema")
    assert schema_check_error(json.loads(SCHEMA.schema)) is None


def test_vllm_is_asked_for_the_backend_that_keeps_json_strict() -> None:
    cfg = EngineConfig(kind="vllm", model="/m")
    assert engine_kwargs(cfg)["structured_outputs_config"] == {"backend": "guidance"}
    cfg = EngineConfig(kind="vllm", model="/m", vllm={"structured_outputs_backend": "xgrammar"})
    assert engine_kwargs(cfg)["structured_outputs_config"] == {"backend": "xgrammar"}
    cfg = EngineConfig(kind="vllm", model="/m", vllm={"extra": {"structured_outputs_config": {"backend": "auto", "disable_any_whitespace": True}}})
    assert engine_kwargs(cfg)["structured_outputs_config"] == {"backend": "auto", "disable_any_whitespace": True}
