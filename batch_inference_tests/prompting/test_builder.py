"""RequestBuilder: record -> (prompt, sampling); every bad record gets an error naming it."""

from __future__ import annotations

import pytest

from batch_inference.engines import ChatPrompt, ResponseFormat
from batch_inference.judges import MissingFieldError
from batch_inference.prompting import InferConfig, RequestBuilder, RequestError, derive_seed


def build(record: dict, **infer) -> object:
    return RequestBuilder(InferConfig(**infer)).build(record, 0)


def test_text_template_and_per_record_seed() -> None:
    req = build({"id": "a", "q": "why"}, template="Q: {q}", sampling={"seed": 3, "max_tokens": 8})
    assert req.prompt == "Q: why" and req.params.max_tokens == 8
    assert req.params.seed == derive_seed(3, "a", 0) and req.params.response_format is None


def test_record_messages_become_a_chat_prompt_with_the_spec_system_turn() -> None:
    req = build({"id": "a", "messages": [{"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": [{"type": "text", "text": "he"}, {"type": "text", "text": "llo"}]},
                                         {"role": "user", "content": "again"}]}, system="be brief")
    assert req.prompt == ChatPrompt((("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("user", "again")))
    # a record's own system turn wins; developer is a system turn
    own = build({"id": "b", "messages": [{"role": "developer", "content": "mine"}, {"role": "user", "content": "x"}]}, system="spec")
    assert own.prompt.messages == (("system", "mine"), ("user", "x"))


def test_messages_built_from_record_fields() -> None:
    req = build({"id": "a", "question": "2+2?"}, messages=[{"role": "system", "content": "math"}, {"role": "user", "content": "Q: {question}"}])
    assert req.prompt.messages == (("system", "math"), ("user", "Q: 2+2?"))
    with pytest.raises(MissingFieldError, match="question"):
        build({"id": "b"}, messages=[{"role": "user", "content": "{question}"}])


def test_completions_style_prompt_field() -> None:
    assert build({"id": "a", "prompt": "once upon"}).prompt == "once upon"


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"id": "m0"}, "bad_request: record 'm0': has neither 'messages'"),
        ({"id": "m1", "messages": []}, "bad_messages: record 'm1': 'messages' must be a non-empty list"),
        ({"id": "m2", "messages": "hello"}, "bad_messages: record 'm2'"),
        ({"id": "m3", "messages": [{"role": "wizard", "content": "x"}]}, r"bad_messages: record 'm3': messages\[0\].role 'wizard'"),
        ({"id": "m4", "messages": [{"role": "user"}]}, r"messages\[0\] has no content"),
        ({"id": "m5", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "only text parts"),
        ({"id": "m6", "messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, "role 'tool'"),
    ],
)
def test_bad_messages_name_the_record(record: dict, match: str) -> None:
    with pytest.raises(RequestError, match=match):
        build(record)


def test_per_record_sampling_overrides_within_limits() -> None:
    infer = {"template": "{q}", "sampling": {"max_tokens": 16, "seed": 1}, "limits": {"max_tokens": 100}}
    req = build({"id": "a", "q": "x", "sampling": {"max_completion_tokens": 50, "temperature": 0.7, "stop": "\n", "seed": 9, "n": 1}}, **infer)
    assert (req.params.max_tokens, req.params.temperature, req.params.stop) == (50, 0.7, ("\n",))
    assert req.params.seed == derive_seed(9, "a", 0)
    assert build({"id": "b", "q": "x"}, **infer).params.max_tokens == 16


@pytest.mark.parametrize(
    ("sampling", "match"),
    [
        ({"max_tokens": 1_000_000}, r"bad_sampling: record 'r': sampling.max_tokens is 1000000: must be an integer in \[1, limits.max_tokens 100\]"),
        ({"n": 4}, "sampling.n is 4: one completion per request"),
        ({"temperature": 9}, "sampling.temperature is 9"),
        ({"logprobs": True}, r"unsupported keys \['logprobs'\]"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "5 strings > limits.stop 4"),
        ("hot", "'sampling' must be an object"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be in"),
    ],
)
def test_out_of_bounds_overrides_name_the_record(sampling: object, match: str) -> None:
    with pytest.raises(RequestError, match=match):
        build({"id": "r", "q": "x", "sampling": sampling}, template="{q}", limits={"max_tokens": 100})


def test_sampling_field_off_ignores_the_field() -> None:
    assert build({"id": "r", "q": "x", "sampling": {"n": 9}}, template="{q}", sampling_field=None).params.max_tokens == 64


def test_response_format_from_spec_and_record() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec_fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    req = build({"id": "a", "q": "x"}, template="{q}", response_format=spec_fmt)
    assert req.params.response_format == ResponseFormat("json_schema", '{"properties":{"a":{"type":"integer"}},"type":"object"}')
    rec = build({"id": "b", "q": "x", "response_format": {"type": "json_object"}}, template="{q}", response_format=spec_fmt)
    assert rec.params.response_format == ResponseFormat("json_object")
    with pytest.raises(RequestError, match="bad_request: record 'c': response_format"):
        build({"id": "c", "q": "x", "response_format": {"type": "yaml"}}, template="{q}")
    # results are validated against the schema, so a record's schema must be one
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
    with pytest.raises(RequestError, match=r"bad_request: record 'd': response_format.json_schema.schema: .*not a valid JSON Schema"):
        build({"id": "d", "q": "x", "response_format": bad}, template="{q}")


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="not both"):
        InferConfig(template="{q}", messages=[{"role": "user", "content": "{q}"}])
    with pytest.raises(ValueError, match="'system' applies to chat"):
        InferConfig(template="{q}", system="x")
    with pytest.raises(ValueError, match="sampling.max_tokens 5000 > limits.max_tokens 4096"):
        InferConfig(template="{q}", sampling={"max_tokens": 5000})


def test_a_response_format_is_validated_once_per_process_not_per_record(monkeypatch: pytest.MonkeyPatch) -> None:
    from batch_inference.prompting import builder as builder_module

    validated: list[object] = []
    real = builder_module._validated_format
    monkeypatch.setattr(builder_module, "_validated_format", lambda value: validated.append(value) or real(value))
    builder_module._cached_format.cache_clear()
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
    b = RequestBuilder(InferConfig(template="{q}"))
    formats = {b.build({"id": f"r{i}", "q": "x", "response_format": schema}, attempt).params.response_format
               for i in range(20) for attempt in range(2)}
    assert formats == {ResponseFormat("json_schema", '{"properties":{"a":{"type":"integer"}},"type":"object"}')}
    assert len(validated) == 1  # 40 requests, one validation and one schema serialisation
    b.build({"id": "s", "q": "x", "response_format": {"type": "json_object"}}, 0)
    for rid in ("bad-1", "bad-2"):  # a bad format is still each record's own error, naming it
        with pytest.raises(RequestError, match=f"bad_request: record '{rid}': response_format"):
            b.build({"id": rid, "q": "x", "response_format": {"type": "yaml"}}, 0)
    assert len(validated) == 3


def test_a_record_names_its_adapter_among_the_specs() -> None:
    from batch_inference.prompting import RequestBuilder, RequestError

    builder = RequestBuilder(InferConfig(template="{q}", adapter="a1", adapters=("a1", "a2")))
    assert builder.build({"id": "x", "q": "hi"}, 0).params.adapter == "a1"  # the phase's adapter
    assert builder.build({"id": "x", "q": "hi", "adapter": "a2"}, 0).params.adapter == "a2"
    assert builder.build({"id": "x", "q": "hi", "adapter": None}, 0).params.adapter is None  # the base model
    with pytest.raises(RequestError, match=r"bad_request: record 'x'.*adapter 'a3' is not one of the spec's adapters: a1, a2"):
        builder.build({"id": "x", "q": "hi", "adapter": "a3"}, 0)
    bare = RequestBuilder(InferConfig(template="{q}"))
    with pytest.raises(RequestError, match="not one of the spec's adapters: none"):
        bare.build({"id": "x", "q": "hi", "adapter": "a1"}, 0)
    ignored = RequestBuilder(InferConfig(template="{q}", adapter_field=None))
    assert ignored.build({"id": "x", "q": "hi", "adapter": "a1"}, 0).params.adapter is None
